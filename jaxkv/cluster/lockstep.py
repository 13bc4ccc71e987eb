"""Check that every process of a multi-process engine made the same step decisions.

Across hosts, each process runs its own copy of the host side (scheduler, KV cache
manager, offload connector) and feeds the same SPMD step. Nothing on the device
notices when two copies disagree: each process places its own metadata, so a different
block table silently reads another request's KV, and a different batch shape makes
the processes call different programs and wait for each other forever. So each
process digests its step decisions (:func:`step_digest`: scheduled request ids, token
counts and token ids, block tables, prefix hits, preemptions) and :class:`LockstepCheck`
compares the digests of all processes before the step touches the device.

The digests travel through a key-value store with a blocking, time-limited read (the
coordinator's store of ``jax.distributed``; :mod:`jaxkv.cluster.distributed` adapts it):
each process writes its digest under the step's key and reads the others'. A mismatch
raises :class:`LockstepMismatchError` in every process at the same step, since all see
all digests; a peer that never writes (it crashed, or raised before the check) raises
:class:`LockstepTimeoutError` after ``timeout_s`` instead of a hang. A process whose
call ran out of steps checks an end marker (``None``), so a peer that still has a
step sees a mismatch rather than waiting for a step that will never come.

Host only (no JAX); the engine calls a check through its ``step_check`` hook.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import xxhash

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.serving.scheduler import SchedulerOutput

END = "end"
"""The summary of a call with no step left (the end marker's decisions)."""


class LockstepError(JaxkvError, RuntimeError):
    """The processes of a multi-process engine are no longer in lockstep (or a check was
    set up wrong: a ``ValueError`` subclass below says so)."""


class LockstepSetupError(LockstepError, ValueError):
    """A lockstep check given a bad process id, count or timeout."""


class LockstepMismatchError(LockstepError):
    """At ``step``, processes ``differing`` decided differently from process 0."""

    def __init__(
        self, name: str, step: int, digests: Sequence[str], summaries: Sequence[str], differing: Sequence[int]
    ) -> None:
        self.step = step
        self.digests = tuple(digests)
        self.summaries = tuple(summaries)
        self.differing = tuple(differing)
        decided = "; ".join(
            f"process {p}: {s} [{d[:8]}]" for p, (d, s) in enumerate(zip(digests, summaries, strict=True))
        )
        super().__init__(
            f"lockstep {name!r} step {step}: processes {list(differing)} decided differently from process 0 ({decided})"
        )


class LockstepTimeoutError(LockstepError, TimeoutError):
    """At ``step``, processes ``missing`` wrote no digest within the time limit."""

    def __init__(self, name: str, step: int, missing: Sequence[int], timeout_s: float) -> None:
        self.step = step
        self.missing = tuple(missing)
        super().__init__(
            f"lockstep {name!r} step {step}: no decisions from processes {list(missing)} within {timeout_s:g} s "
            "(crashed, or raised before the check)"
        )


class KeyValueStore(Protocol):
    """A store shared by all processes (the method names of jax's distributed client)."""

    def key_value_set(self, key: str, value: str) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        """The value of ``key`` once some process set it; ``TimeoutError`` after the limit."""
        ...

    def key_value_delete(self, key: str) -> None: ...


def step_digest(output: SchedulerOutput | None) -> tuple[str, str]:
    """``(digest, summary)`` of one step's decisions; ``None`` (no step left) gives the end marker.

    The digest (xxh3-128, hex) covers, per scheduled chunk, the request id, its
    computed and new token counts, whether it samples, its prefix hit at admission,
    its token ids and its block table in every group; then the preempted request ids.
    The summary is a few counts, for the error message.
    """
    if output is None:
        return xxhash.xxh3_128_hexdigest(END.encode()), END
    h = xxhash.xxh3_128()
    for chunk in output.chunks:
        seq = chunk.seq
        h.update(
            f"{seq.request_id}|{chunk.num_computed_tokens}|{chunk.num_new_tokens}|{chunk.samples:d}"
            f"|{seq.num_cached_tokens}|{chunk.token_ids}|{chunk.block_ids}\n".encode()
        )
    h.update(f"preempted {[s.request_id for s in output.preempted]}".encode())
    summary = f"{len(output.chunks)} chunks, {output.num_tokens} tokens, {len(output.preempted)} preempted"
    return h.hexdigest(), summary


class LockstepCheck:
    """Compares every step's decisions across ``num_processes`` processes through ``store``.

    Call it once per step with the step's :class:`SchedulerOutput`, before the step's
    device work, and with ``None`` when a call has no step left (what
    :class:`~jaxkv.serving.engine.Engine` does with it as ``step_check``). Steps are
    counted across calls. ``name`` keeps the keys of two checks apart (one per engine).
    Each step costs one write and ``num_processes - 1`` blocking reads of the store;
    each process deletes its own key of the step before, once every peer has read it
    (a peer that wrote step ``s`` had read every key of step ``s - 1``).
    """

    def __init__(
        self,
        store: KeyValueStore,
        *,
        process_id: int,
        num_processes: int,
        name: str = "engine",
        timeout_s: float = 60.0,
    ) -> None:
        check_int("num_processes", num_processes, minimum=1, error=LockstepSetupError)
        check_int("process_id", process_id, minimum=0, error=LockstepSetupError)
        if process_id >= num_processes:
            raise LockstepSetupError(f"process_id={process_id} is not in [0, num_processes={num_processes})")
        if not 0 < timeout_s < float("inf"):
            raise LockstepSetupError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.store = store
        self.process_id = process_id
        self.num_processes = num_processes
        self.name = name
        self.timeout_s = timeout_s
        self.num_steps = 0

    def __call__(self, output: SchedulerOutput | None) -> None:
        """Publish this process's decisions for the next step and compare them with every
        process's; :class:`LockstepMismatchError` or :class:`LockstepTimeoutError`."""
        step = self.num_steps
        self.num_steps += 1
        digest, summary = step_digest(output)
        mine = f"{digest} {summary}"
        self.store.key_value_set(self._key(step, self.process_id), mine)
        deadline = time.monotonic() + self.timeout_s
        values = [mine if p == self.process_id else self._read(step, p, deadline) for p in range(self.num_processes)]
        if step:
            self.store.key_value_delete(self._key(step - 1, self.process_id))
        missing = [p for p, v in enumerate(values) if v is None]
        if missing:
            raise LockstepTimeoutError(self.name, step, missing, self.timeout_s)
        answered = [v for v in values if v is not None]  # all of them: none is missing
        digests, summaries = zip(*(v.split(" ", 1) for v in answered), strict=True)
        differing = [p for p, d in enumerate(digests) if d != digests[0]]
        if differing:
            raise LockstepMismatchError(self.name, step, digests, summaries, differing)

    def _read(self, step: int, process: int, deadline: float) -> str | None:
        """A peer's value for ``step``, or None when it is not there by ``deadline``."""
        try:
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            return self.store.blocking_key_value_get(self._key(step, process), wait_ms)
        except TimeoutError:
            return None

    def _key(self, step: int, process: int) -> str:
        return f"jaxkv/lockstep/{self.name}/{step}/{process}"
