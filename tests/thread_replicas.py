"""Replicas serving in threads of the test process (no process start-up to pay): a
router sees only their sockets, so one that stops is one that died."""

import threading

from jaxkv.fleet.protocol import ReplicaAddress
from jaxkv.fleet.replica import Replica, ReplicaSpec, warm_up
from jaxkv.serving.engine import CacheAudit, Engine
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
    """Serves ``ENGINE`` as replica ``name`` in a thread, as :func:`serve_replica` does;
    :meth:`kill` stops its loop and closes it, so it falls silent with its requests
    unanswered, as a killed process does; :meth:`stop` first serves what it holds. Its
    steps wait while :attr:`running` is clear (a hung step: the heartbeat thread goes
    on). Once stopped, :attr:`audit` and :attr:`unfinished` tell what its engine held."""

    def __init__(self, directory, name: str, heartbeat_interval_s: float, curve: CurveKeys | None = None) -> None:
        self.spec = ReplicaSpec(name, ReplicaAddress.ipc(directory, name), ENGINE, heartbeat_interval_s)
        self.curve = curve
        self.running = threading.Event()
        self.running.set()
        self.audit: CacheAudit | None = None
        self.unfinished: int | None = None
        self._stop = threading.Event()
        self._drain = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> ReplicaAddress:
        return self.spec.address

    def kill(self) -> None:
        self.running.set()
        self._stop.set()
        self.thread.join()

    def stop(self) -> None:
        self.running.set()
        self._drain.set()
        self.thread.join()

    def _serve(self) -> None:
        address = self.spec.address
        with self.spec.publisher(curve=self.curve) as events:
            engine = Engine.build(**self.spec.engine, kv_events=events)
            warm_up(engine)
            step = engine.step

            def held_step():
                self.running.wait()
                return step()

            engine.step = held_step
            replica = Replica(
                self.name, engine, address, heartbeat_interval_s=self.spec.heartbeat_interval_s, curve=self.curve
            )
            try:
                replica.serve(lambda: self._stop.is_set() or (self._drain.is_set() and not engine.has_unfinished))
            finally:
                replica.close()
            self.audit = engine.audit()
            self.unfinished = engine.num_running + engine.num_waiting
