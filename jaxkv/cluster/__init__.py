"""One model over many processes: the launcher (:mod:`jaxkv.cluster.launcher`), the
``jax.distributed`` join (:mod:`jaxkv.cluster.distributed`) and the per-step check that
every process decided the same (:mod:`jaxkv.cluster.lockstep`).

Import the submodules directly; the launcher and the lockstep check import no JAX.
"""
