"""Soak of the routing plane: replica processes killed, hung, stalled and restarted, and
a hostile client, under two routers; every request must be answered exactly once.

``--num_replicas`` replica processes (tiny-llama on CPU, one XLA thread each, CURVE on
every socket with keys made for the run) serve ``--requests`` requests sent by
``--num_routers`` routers in this process (closed loop, ``--concurrency`` requests in
flight per router; prompts: one of 8 tenants' system prompts, salted per tenant, and a
short random message). While they run (at fixed fractions of the requests sent):

- the last replica is killed (SIGKILL) and, later, restarted on the same addresses
  (a new process: its KV event publisher numbers from 0 again);
- one replica's step hangs for ``--hang_s`` seconds (its heartbeat thread goes on);
- one replica is killed and restarted at once;
- one replica's process is stopped (SIGSTOP) for 3 s, then continued;
- a hostile client with the deployment's keys sends each replica malformed, multi-frame,
  oversized (over the announced limit, and past the socket's own) and forged frames,
  ``--hostile_rate`` per second;
- a replay-abuse client sends each replica's replay socket starts past any buffer
  (``2**63``, ``2**64 - 1``, random 8 bytes), malformed requests, and requests from a
  socket that never reads its answers, ``--hostile_rate`` per second;
- one submission in ``--over_long_every`` is an over-long prompt through the routers
  (past ``max_model_len``, or past the request byte limit).

Requests are held back at each fault's share until the fault has run (it waits for
the replicas to be back from the one before), so every fault runs at every size.
Checked at the end: every fault ran, every submitted request answered exactly once
(tokens or an error naming why), every over-long prompt refused at once naming the
limit, no healthy replica (not killed, hung or stopped) dropped for longer than one
heartbeat interval, the replicas' peak memory and the routers' growth, and, in every
replica still running, no unfinished request and no block or state leaked
(``Engine.audit``). Everything binds ``ipc://`` paths in a fresh private directory; the
run stops by itself after ``--time_limit`` seconds at most, and every replica process
is killed on any exit.

    python scripts/soak_route.py                  # 5,000 requests: 4 to 10 minutes on a shared 2-core host
    python scripts/soak_route.py --requests 2000  # a shorter run
    python scripts/soak_route.py --quick          # 300 requests over 2 replicas

Exits 0 when every check passes, 1 otherwise (the failed checks printed), 2 on bad
input (one line ``soak_route.py: error: ...``).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import zmq
from absl import app, flags, logging

from jaxkv.commands.cli import exit_error, flags_parser, write_json
from jaxkv.fleet.protocol import (
    CancelRequest,
    GenerateRequest,
    GenerateResult,
    ReplicaAddress,
    ResetPrefixCache,
    max_frame_bytes,
    max_request_bytes,
)
from jaxkv.fleet.replica import Replica, ReplicaSpec, warm_up
from jaxkv.fleet.router import RoutedOutput, Router, RouterError
from jaxkv.serving.engine import Engine
from jaxkv.serving.zmq_security import ENV_CURVE_DIR, CurveKeys, SecureContext, private_ipc_dir

PROG = "soak_route.py"
FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 5000, "requests sent in all (over every router)", lower_bound=1)
flags.DEFINE_integer("num_replicas", 4, "replica processes", lower_bound=2)
flags.DEFINE_integer("num_routers", 2, "routers (in this process)", lower_bound=1)
flags.DEFINE_integer("concurrency", 12, "requests in flight per router", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 4, "tokens generated per request", lower_bound=1)
flags.DEFINE_float("heartbeat_interval", 1.0, "seconds between heartbeats", lower_bound=0.05)
flags.DEFINE_float(
    "hang_timeout", 4.0, "seconds a replica with requests in flight may go without a step", lower_bound=0.1
)
flags.DEFINE_float("hang_s", 8.0, "seconds one replica's step hangs", lower_bound=0)
flags.DEFINE_float("hostile_rate", 20.0, "hostile frames per second (and as many replay-abuse requests)", lower_bound=0)
flags.DEFINE_integer(
    "over_long_every", 50, "one submission in this many is an over-long prompt (0: none)", lower_bound=0
)
flags.DEFINE_float("time_limit", 900.0, "seconds after which the run stops, answered or not", lower_bound=1)
flags.DEFINE_bool("quick", False, "a short run: 2 replicas, 300 requests")
flags.DEFINE_integer("seed", 0, "prompt seed", lower_bound=0)
flags.DEFINE_string("out", None, "write the report as JSON here")
flags.DEFINE_string("child", None, "(internal) serve this replica spec (JSON) as a child process")
flags.DEFINE_string("control", None, "(internal) the run's control directory")

QUICK = {"requests": 300, "num_replicas": 2, "concurrency": 6, "hang_s": 5.0, "time_limit": 300.0}
ENGINE = {
    "model_name": "tiny-llama",
    "memory_bytes": 2 << 20,
    "max_model_len": 256,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
}
ONE_THREAD = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
NUM_TENANTS = 8
SYSTEM_LEN = 64


# ------------------------------------------------------------------ a replica process
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve_child(spec: ReplicaSpec, control: Path) -> None:
    """Serve ``spec`` until ``control/<name>.stop`` appears and the engine is idle (its
    cancels and last requests served, 30 s at most), or the parent dies, its step held
    while ``control/<name>.hang`` exists; then write its audit."""
    parent = os.getppid()
    stop, hang = control / f"{spec.name}.stop", control / f"{spec.name}.hang"
    stopping: list[float] = []

    def should_stop() -> bool:
        if os.getppid() != parent:
            return True
        if not stopping and stop.exists():
            stopping.append(time.monotonic())
        return bool(stopping) and (not engine.has_unfinished or time.monotonic() - stopping[0] > 30)

    with spec.publisher() as events:
        engine = Engine.build(**spec.engine, kv_events=events)
        warm_up(engine)
        step = engine.step

        def held_step() -> object:
            while hang.exists():
                time.sleep(0.05)
            return step()

        engine.step = held_step  # type: ignore[method-assign]
        replica = Replica(spec.name, engine, spec.address, heartbeat_interval_s=spec.heartbeat_interval_s)
        try:
            replica.serve(should_stop)
        finally:
            replica.close()
        audit = engine.audit()
        report = {
            "unfinished": engine.num_running + engine.num_waiting,
            "device_blocks_leaked": audit.device_blocks_leaked,
            "host_blocks_leaked": audit.host_blocks_leaked,
            "bad_messages": replica.num_bad_messages,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        (control / f"{spec.name}.audit.json").write_text(json.dumps(report))


# ------------------------------------------------------------------ the fleet
class Fleet:
    """The replica processes of the run: started, killed, hung, stopped, restarted."""

    def __init__(self, specs: dict[str, ReplicaSpec], control: Path, env: dict[str, str]) -> None:
        self.specs, self.control, self.env = specs, control, env
        self.processes: dict[str, subprocess.Popen] = {}
        self.faulty: dict[str, float] = {}  # replica killed, hung or stopped -> the earliest it may be back
        self.grace_s = 2 * FLAGS.heartbeat_interval + FLAGS.hang_timeout  # for the routers to notice

    def start(self, name: str) -> None:
        cmd = [sys.executable, __file__, f"--child={self.specs[name].to_json()}", f"--control={self.control}"]
        self.processes[name] = subprocess.Popen(cmd, env=self.env)
        if name in self.faulty:
            self.faulty[name] = time.monotonic() + self.grace_s

    def kill(self, name: str) -> None:
        self.faulty[name] = float("inf")
        self.processes[name].kill()
        self.processes[name].wait()

    def hang(self, name: str, seconds: float) -> None:
        self.faulty[name] = time.monotonic() + seconds + self.grace_s
        (self.control / f"{name}.hang").touch()
        threading.Timer(seconds, (self.control / f"{name}.hang").unlink).start()

    def stall(self, name: str, seconds: float) -> None:
        self.faulty[name] = time.monotonic() + seconds + self.grace_s
        self.processes[name].send_signal(signal.SIGSTOP)
        threading.Timer(seconds, self.processes[name].send_signal, (signal.SIGCONT,)).start()

    def stop_all(self, timeout_s: float = 30.0) -> None:
        for name in self.processes:
            (self.control / f"{name}.stop").touch()
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


# ------------------------------------------------------------------ the hostile client
Attack = dict[str, tuple[list[zmq.Socket], Callable[[], list[bytes]]]]
"""Kind of message -> (the sockets it goes out on, one at random; its frames)."""


def attack(kinds: Attack, readers: Sequence[zmq.Socket], rate: float, stop: threading.Event, seed: int) -> dict:
    """Send a message of a kind drawn at random ``rate`` times a second until ``stop``,
    dropping whatever answers come back on ``readers``; how many of each kind went out."""
    sockets = {id(sock): sock for group, _ in kinds.values() for sock in group}.values()
    sent = dict.fromkeys(kinds, 0)
    rng = random.Random(seed)
    while not stop.wait(1 / rate if rate else 1.0):
        if not rate:
            continue
        kind = rng.choice(list(kinds))
        group, frames = kinds[kind]
        try:
            rng.choice(group).send_multipart(frames(), zmq.NOBLOCK)
            sent[kind] += 1
        except zmq.ZMQError:
            pass
        for sock in readers:
            while sock.poll(0):
                sock.recv_multipart()
    for sock in sockets:
        sock.close(linger=0)
    return sent


def hostile(addresses: Sequence[ReplicaAddress], keys: CurveKeys, rate: float, stop: threading.Event) -> dict:
    """Send malformed, multi-frame, oversized and forged frames to every replica until
    ``stop``; how many of each."""
    secure = SecureContext(keys)
    sockets = [secure.connect(zmq.DEALER, "requests", a.requests) for a in addresses]
    big = b"\x00" * (max_request_bytes(ENGINE["max_model_len"]) + 1)
    huge = b"\x00" * (max_frame_bytes(ENGINE["max_model_len"]) + 1)
    kinds: Attack = {
        "garbage": (sockets, lambda: [os.urandom(random.randint(1, 64))]),
        "multi_frame": (sockets, lambda: [b"hello", b"world"]),
        "oversized": (sockets, lambda: [big]),
        "past_the_socket_limit": (sockets, lambda: [huge]),
        "forged_answer": (sockets, lambda: [msgspec.msgpack.encode(GenerateResult("x", "r0", [1], 0.0, 0))]),
        "bad_tokens": (sockets, lambda: [msgspec.msgpack.encode(GenerateRequest("h", [10**9], 2))]),
        "cancel_guess": (
            sockets,
            lambda: [msgspec.msgpack.encode(CancelRequest(f"route-{random.randint(0, 99)}"))],
        ),
        "reset": (sockets, lambda: [msgspec.msgpack.encode(ResetPrefixCache("h"))]),
    }
    try:
        return attack(kinds, sockets, rate, stop, seed=1)
    finally:
        secure.term()


def replay_abuse(addresses: Sequence[ReplicaAddress], keys: CurveKeys, rate: float, stop: threading.Event) -> dict:
    """Send every replica's replay socket starts past any buffer, malformed requests and
    requests from a socket that never reads its answers, until ``stop``; how many of each."""
    secure = SecureContext(keys)
    askers = [secure.connect(zmq.DEALER, "replay", a.replay) for a in addresses]
    mute = [secure.connect(zmq.DEALER, "replay", a.replay, RCVHWM=1) for a in addresses]  # never read
    kinds: Attack = {
        "start_2**64-1": (askers, lambda: [b"", b"\xff" * 8]),
        "start_2**63": (askers, lambda: [b"", (2**63).to_bytes(8, "big")]),
        "random_start": (askers, lambda: [b"", os.urandom(8)]),
        "short_start": (askers, lambda: [b"", os.urandom(7)]),
        "no_delimiter": (askers, lambda: [os.urandom(8)]),
        "never_read": (mute, lambda: [b"", bytes(8)]),
    }
    try:
        return attack(kinds, askers, rate, stop, seed=2)
    finally:
        secure.term()


# ------------------------------------------------------------------ the run
def prompts(rng: random.Random) -> Callable[[], tuple[list[int], str]]:
    systems = [[rng.randrange(512) for _ in range(SYSTEM_LEN)] for _ in range(NUM_TENANTS)]

    def one() -> tuple[list[int], str]:
        tenant = rng.randrange(NUM_TENANTS)
        return systems[tenant] + [rng.randrange(512) for _ in range(rng.randint(8, 40))], f"tenant-{tenant}"

    return one


def over_long(rng: random.Random) -> list[int]:
    """A prompt no replica admits: past ``max_model_len``, or past the request byte limit too."""
    n = ENGINE["max_model_len"] + rng.randint(0, 64) if rng.random() < 0.5 else 30_000
    return [rng.randrange(512) for _ in range(n)]


class Drops:
    """Per router, when each replica was dropped, and how long healthy replicas stayed out."""

    def __init__(self) -> None:
        self.since: dict[tuple[int, str], tuple[float, bool]] = {}  # (router, replica) -> (when, healthy)
        self.healthy_out_s: list[float] = []
        self.num_drops = 0

    def watch(self, i: int, router: Router, fleet: Fleet) -> None:
        now = time.monotonic()
        dropped = router.dropped_replicas
        for name in dropped:
            if (i, name) not in self.since:
                self.num_drops += 1
                self.since[(i, name)] = (now, name not in fleet.faulty)
        for (j, name), (when, healthy) in list(self.since.items()):
            if j == i and name not in dropped:
                del self.since[(j, name)]
                if healthy:
                    self.healthy_out_s.append(now - when)
        out = {n for _, n in self.since}
        for name, back in list(fleet.faulty.items()):
            if now >= back and name not in out:
                del fleet.faulty[name]

    def finish(self) -> None:
        now = time.monotonic()
        self.healthy_out_s += [now - when for when, healthy in self.since.values() if healthy]


def run(fleet: Fleet, routers: list[Router], keys: CurveKeys) -> dict:
    total = FLAGS.requests
    make = prompts(random.Random(FLAGS.seed))
    answers: list[dict[str, RoutedOutput]] = [{} for _ in routers]
    submitted: list[set[str]] = [set() for _ in routers]
    long_rng = random.Random(FLAGS.seed + 1)
    long_prompts: dict = {"sent": 0, "refused_at_once": 0, "routed": set()}
    duplicates = 0
    names = list(fleet.specs)
    last, hung, killed, stalled = names[-1], names[-2], names[1 % len(names)], names[0]
    # (fraction of the requests sent, what, action, whether it waits for every replica to be back)
    faults: list[tuple[float, str, Callable[[], None], bool]] = [
        (0.15, f"kill {last}", lambda: fleet.kill(last), True),
        (0.25, f"restart {last}", lambda: fleet.start(last), False),
        (0.35, f"hang {hung}", lambda: fleet.hang(hung, FLAGS.hang_s), True),
        (0.55, f"kill and restart {killed}", lambda: (fleet.kill(killed), fleet.start(killed)), True),
        (0.70, f"stop {stalled} for 3 s", lambda: fleet.stall(stalled, 3.0), True),
    ]
    num_faults = len(faults)
    log: list[str] = []
    drops = Drops()
    stop = threading.Event()
    hostile_sent: dict = {}
    replay_abuse_sent: dict = {}
    addresses = [s.address for s in fleet.specs.values()]
    attackers = [
        threading.Thread(
            target=lambda: hostile_sent.update(hostile(addresses, keys, FLAGS.hostile_rate, stop)), daemon=True
        ),
        threading.Thread(
            target=lambda: replay_abuse_sent.update(replay_abuse(addresses, keys, FLAGS.hostile_rate, stop)),
            daemon=True,
        ),
    ]
    for attacker in attackers:
        attacker.start()
    start = time.monotonic()
    rss_quarter = None
    sent = 0
    try:
        while time.monotonic() - start < FLAGS.time_limit:
            held_at = min(total, int(faults[0][0] * total)) if faults else total  # until the fault has run
            for i, router in enumerate(routers):
                while sent < held_at and len(submitted[i]) - len(answers[i]) < FLAGS.concurrency:
                    prompt, salt = make()
                    submitted[i].add(router.submit(prompt, FLAGS.max_new_tokens, cache_salt=salt))
                    sent += 1
                    if FLAGS.over_long_every and sent % FLAGS.over_long_every == 0:
                        long_prompts["sent"] += 1
                        try:
                            rid = router.submit(over_long(long_rng), FLAGS.max_new_tokens)
                        except RouterError as err:
                            long_prompts["refused_at_once"] += "max_model_len=" in str(err)
                        else:  # no live replica to say its limits: answered through poll
                            submitted[i].add(rid)
                            long_prompts["routed"].add(rid)
                for out in router.poll(0.005):
                    if out.request_id in answers[i]:
                        duplicates += 1
                    answers[i][out.request_id] = out
                drops.watch(i, router, fleet)
            while faults and sent >= faults[0][0] * total and not (faults[0][3] and fleet.faulty):
                at, what, action, _ = faults.pop(0)
                action()
                log.append(f"{time.monotonic() - start:6.1f} s ({at:.0%} sent): {what}")
                print(log[-1], flush=True)
            if rss_quarter is None and sent >= total // 4:
                rss_quarter = peak_rss_bytes()
            if sent >= total and all(len(a) == len(s) for a, s in zip(answers, submitted, strict=True)):
                break
        wall = time.monotonic() - start
        settle = time.monotonic() + 2 * FLAGS.heartbeat_interval  # cancels reach their replicas
        while time.monotonic() < settle:
            for i, router in enumerate(routers):
                for out in router.poll(0.01):
                    duplicates += out.request_id in answers[i]
                    answers[i][out.request_id] = out
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join()
    drops.finish()
    outputs = [o for a in answers for o in a.values()]
    errors: dict[str, int] = {}
    for o in outputs:
        if o.error is not None:
            key = o.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    long_answered = [o for o in outputs if o.request_id in long_prompts["routed"]]
    return {
        "requests": sent + len(long_prompts["routed"]),
        "faults_run": len(log),
        "faults_planned": num_faults,
        "over_long_sent": long_prompts["sent"],
        "over_long_refused_at_once": long_prompts["refused_at_once"],
        "over_long_answered_with_an_error": sum(o.error is not None for o in long_answered),
        "answered": len(outputs),
        "unanswered": sum(len(s - set(a)) for a, s in zip(answers, submitted, strict=True)),
        "answered_twice": duplicates,
        "with_tokens": sum(o.error is None for o in outputs),
        "errors": errors,
        "retried": sum(o.attempts > 1 for o in outputs),
        "wall_s": wall,
        "requests_per_s": len(outputs) / wall,
        "faults": log,
        "drops": drops.num_drops,
        "readmissions": sum(r.num_readmissions for r in routers),
        "healthy_out_max_s": max(drops.healthy_out_s, default=0.0),
        "healthy_drops": len(drops.healthy_out_s),
        "router_bad_messages": sum(r.num_bad_messages for r in routers),
        "hostile_sent": hostile_sent,
        "replay_abuse_sent": replay_abuse_sent,
        "router_replay_timeouts": sum(r.num_replay_timeouts for r in routers),
        "router_restarts_seen": sum(r.num_restarts for r in routers),
        "router_rss_growth_bytes": peak_rss_bytes() - (rss_quarter or peak_rss_bytes()),
    }


def wait_ready(fleet: Fleet, routers: list[Router], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    for router in routers:
        while True:
            dead = [name for name, p in fleet.processes.items() if p.poll() is not None]
            if dead:
                exit_error(PROG, f"replica processes {dead} exited while starting", status=1)
            try:
                router.wait_ready(1.0)
                break
            except RouterError:
                if time.monotonic() > deadline:
                    raise


def checks(report: dict) -> list[str]:
    """The failed checks, in words."""
    failed = []
    if report["faults_run"] != report["faults_planned"]:
        failed.append(f"{report['faults_planned'] - report['faults_run']} faults did not run")
    if report["unanswered"] or report["answered_twice"] or report["answered"] != report["requests"]:
        failed.append("not every request was answered exactly once")
    if report["over_long_refused_at_once"] + report["over_long_answered_with_an_error"] != report["over_long_sent"]:
        failed.append("an over-long prompt was not refused")
    if report["healthy_out_max_s"] > FLAGS.heartbeat_interval:
        failed.append(f"a healthy replica stayed dropped {report['healthy_out_max_s']:.2f} s")
    for name, audit in report["replicas"].items():
        if audit is None:
            failed.append(f"{name} wrote no audit")
        elif audit["unfinished"] or audit["device_blocks_leaked"] or audit["host_blocks_leaked"]:
            failed.append(f"{name} leaked: {audit}")
    if report["router_rss_growth_bytes"] > 256 << 20:
        failed.append(f"the routers grew by {report['router_rss_growth_bytes']:,} bytes")
    return failed


def main(argv: Sequence[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.child:
        serve_child(ReplicaSpec.from_json(FLAGS.child), Path(FLAGS.control))
        return
    if FLAGS.quick:
        for name, value in QUICK.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the replicas are killed
    with private_ipc_dir("soak_route-") as tmp:
        control = Path(tmp)
        keys = CurveKeys.generate()
        keys.write(control / "keys")
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            **ONE_THREAD,
            ENV_CURVE_DIR: str(control / "keys"),
            "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
        }
        names = [f"r{i}" for i in range(FLAGS.num_replicas)]
        specs = {n: ReplicaSpec(n, ReplicaAddress.ipc(tmp, n), ENGINE, FLAGS.heartbeat_interval) for n in names}
        fleet = Fleet(specs, control, env)
        routers: list[Router] = []
        try:
            for name in names:
                fleet.start(name)
            for _ in range(FLAGS.num_routers):
                routers.append(
                    Router(
                        {n: s.address for n, s in specs.items()},
                        heartbeat_interval_s=FLAGS.heartbeat_interval,
                        hang_timeout_s=FLAGS.hang_timeout,
                        request_timeout_s=120.0,
                        curve=keys,
                    )
                )
            started = time.monotonic()
            wait_ready(fleet, routers)
            print(
                f"{FLAGS.num_replicas} replicas serving after {time.monotonic() - started:.1f} s; "
                f"{FLAGS.requests} requests over {FLAGS.num_routers} routers",
                flush=True,
            )
            report = run(fleet, routers, keys)
            fleet.stop_all()
            report["replicas"] = {}
            for name in names:
                path = control / f"{name}.audit.json"
                report["replicas"][name] = json.loads(path.read_text()) if path.exists() else None
        finally:
            for router in routers:
                router.close()
            fleet.kill_all()
    report["replica_peak_rss_max_bytes"] = max(
        (a["peak_rss_bytes"] for a in report["replicas"].values() if a), default=0
    )
    failed = checks(report)
    print(json.dumps({k: v for k, v in report.items() if k != "replicas"}, indent=2))
    for name, audit in report["replicas"].items():
        print(f"{name}: {audit}")
    if FLAGS.out:
        flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
        write_json(PROG, FLAGS.out, {"flags": flag_values, "report": report, "failed": failed})
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
