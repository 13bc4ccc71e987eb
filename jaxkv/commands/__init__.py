"""The command-line programs a wheel installs, as library modules (each command's flags in
a registry of its own, nothing set and no JAX imported on import; ``run()`` sets XLA's CPU
device count, then imports JAX): ``jaxkv-plan`` (:mod:`jaxkv.commands.plan`), ``jaxkv-serve``
(:mod:`jaxkv.commands.serve`) and ``jaxkv-simulate`` (:mod:`jaxkv.commands.simulate`);
:mod:`jaxkv.commands.cli` holds what they and the benchmarks share."""
