"""The command-line programs a wheel installs: ``jaxkv-serve`` (:mod:`jaxkv.commands.serve`)
and ``jaxkv-simulate`` (:mod:`jaxkv.commands.simulate`); ``jaxkv-plan`` is :mod:`jaxkv.plan`.
``scripts/serve.py`` and ``scripts/simulate.py`` run the same programs from a checkout."""
