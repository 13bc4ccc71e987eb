"""Replicas serving in threads of the test process (no process start-up to pay): a
router sees only their sockets, so one that stops is one that died."""

import threading

from jaxkv.fleet.protocol import ReplicaAddress
from jaxkv.fleet.replica import ReplicaSpec, serve_replica
from jaxkv.serving.zmq_security import CurveKeys

ENGINE = {
    "model_name": "tiny-llama",
    "memory_bytes": 2 << 20,
    "max_model_len": 256,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 4,
}
"""A small engine of every test replica (``Engine.build`` keyword arguments)."""


class ThreadReplica:
    """Serves ``ENGINE`` as replica ``name`` in a thread; :meth:`kill` stops its loop and
    closes it, so it falls silent with its requests unanswered, as a killed process does."""

    def __init__(self, directory, name: str, heartbeat_interval_s: float, curve: CurveKeys | None = None) -> None:
        self.spec = ReplicaSpec(name, ReplicaAddress.ipc(directory, name), ENGINE, heartbeat_interval_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=serve_replica, args=(self.spec, self._stop.is_set), kwargs={"curve": curve}, daemon=True
        )
        self.thread.start()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> ReplicaAddress:
        return self.spec.address

    def kill(self) -> None:
        self._stop.set()
        self.thread.join()
