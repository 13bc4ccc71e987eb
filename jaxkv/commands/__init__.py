"""The command-line programs a wheel installs, as library modules (flags defined per
command, nothing set on import): ``jaxkv-plan`` (:mod:`jaxkv.commands.plan`), ``jaxkv-serve``
(:mod:`jaxkv.commands.serve`) and ``jaxkv-simulate`` (:mod:`jaxkv.commands.simulate`);
:mod:`jaxkv.commands.cli` holds what they and the benchmarks share."""
