"""Join a ``jax.distributed`` cluster started by :mod:`jaxkv.cluster.launcher`, and check
its processes in lockstep.

:func:`join` initializes ``jax.distributed`` from a process's
:class:`~jaxkv.cluster.launcher.ProcessRole` (CPU processes talk through gloo
collectives, jax's default for CPU clusters). :func:`lockstep_check` builds the
:class:`~jaxkv.cluster.lockstep.LockstepCheck` an :class:`~jaxkv.serving.engine.Engine`
takes as ``step_check``, over the coordinator's key-value store
(:class:`CoordinatorStore`): a round trip to the coordinator per peer and step, with
a time limit, rather than a device collective, which would hang when a peer never
comes.
"""

from __future__ import annotations

import jax

from jaxkv.cluster.launcher import LaunchError, ProcessRole
from jaxkv.cluster.lockstep import LockstepCheck
from jaxkv.errors import JaxkvError


class NotJoinedError(JaxkvError, RuntimeError):
    """A cluster-wide object was asked for in a process that joined no cluster."""


def coordinator_bind_address(coordinator_address: str, bind_host: str | None = None) -> str:
    """Where process 0's coordinator listens: on ``bind_host`` when asked, else on the
    host of ``coordinator_address`` itself (127.0.0.1 for the launcher's one-machine
    clusters), never on every interface (jax's default)."""
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"coordinator address must be host:port, got {coordinator_address!r}")
    return f"{bind_host or host}:{port}"


def join(role: ProcessRole, *, bind_host: str | None = None) -> None:
    """``jax.distributed.initialize`` for ``role``, the coordinator bound as
    :func:`coordinator_bind_address` says; call it before anything touches a device."""
    jax.distributed.initialize(
        coordinator_address=role.coordinator_address,
        num_processes=role.num_processes,
        process_id=role.process_id,
        coordinator_bind_address=coordinator_bind_address(role.coordinator_address, bind_host),
    )


class CoordinatorStore:
    """The key-value store of the ``jax.distributed`` coordinator, with a timed-out read
    raised as ``TimeoutError`` (:class:`~jaxkv.cluster.lockstep.KeyValueStore`).

    jax keeps its client private (``jax._src.distributed.global_state.client``, in jax
    0.10 and 0.11); this class is the one place that reaches it.
    """

    def __init__(self) -> None:
        from jax._src.distributed import global_state

        if global_state.client is None:
            raise NotJoinedError("jax.distributed is not initialized in this process (call join first)")
        self._client = global_state.client

    def key_value_set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        try:
            return self._client.blocking_key_value_get(key, timeout_in_ms)
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" in str(err):
                raise TimeoutError(str(err)) from None
            raise

    def key_value_delete(self, key: str) -> None:
        self._client.key_value_delete(key)


def lockstep_check(name: str = "engine", *, timeout_s: float = 60.0) -> LockstepCheck:
    """A lockstep check of this process against every process of the cluster it joined."""
    return LockstepCheck(
        CoordinatorStore(),
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        name=name,
        timeout_s=timeout_s,
    )
