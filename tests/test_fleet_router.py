"""The router: its policies on fake loads and cached prefixes (pure), prompts hashed as
the replicas' engines hash them, and a replica that dies mid-trace (its requests
retried on another, its prefixes gone from the index, nothing sent to it again)."""

import time

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from thread_replicas import ThreadReplica  # noqa: E402

from jaxkv.core.hashing import BlockHasher, ExtraKeys  # noqa: E402
from jaxkv.fleet.protocol import (  # noqa: E402
    CancelRequest,
    GenerateResult,
    Heartbeat,
    ReplicaAddress,
    ToReplica,
    max_request_bytes,
)
from jaxkv.fleet.router import NoLiveReplicaError, Router, RouterError, pick_replica, queue_tokens  # noqa: E402
from jaxkv.serving.engine import CacheAudit  # noqa: E402
from jaxkv.serving.kv_events import WireBlockStored, external_hash  # noqa: E402
from jaxkv.serving.zmq_security import CurveKeys, SecureContext  # noqa: E402


# --- policies ------------------------------------------------------------------------
def test_prefix_routing_sends_a_prompt_to_its_longest_cached_prefix():
    loads = {"a": 1, "b": 1, "c": 1}
    assert pick_replica("prefix", loads, {"a": 32, "b": 160, "c": 96}, load_penalty=64, turn=0) == "b"


def test_a_busy_replica_loses_its_cached_prefix_to_an_idle_one_past_the_load_penalty():
    cached = {"a": 256}
    assert pick_replica("prefix", {"a": 3, "b": 0}, cached, load_penalty=64, turn=0) == "a"  # 256 - 192 > 0
    assert pick_replica("prefix", {"a": 5, "b": 0}, cached, load_penalty=64, turn=0) == "b"  # 256 - 320 < 0


def test_a_prompt_cached_nowhere_goes_to_the_least_loaded_and_ties_rotate():
    assert pick_replica("prefix", {"a": 2, "b": 1, "c": 2}, {}, load_penalty=64, turn=0) == "b"
    idle = {"a": 0, "b": 0, "c": 0}
    assert [pick_replica("prefix", idle, {}, load_penalty=64, turn=t) for t in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_ignores_loads_and_least_loaded_ignores_prefixes():
    loads, cached = {"a": 5, "b": 0, "c": 9}, {"c": 512}
    assert [pick_replica("round_robin", loads, cached, load_penalty=0, turn=t) for t in range(3)] == ["a", "b", "c"]
    assert pick_replica("least_loaded", loads, cached, load_penalty=0, turn=2) == "b"


def test_bad_policies_and_no_replica_are_refused():
    with pytest.raises(RouterError, match=r"policy must be one of .* got 'random'"):
        pick_replica("random", {"a": 0}, {}, load_penalty=0, turn=0)
    with pytest.raises(NoLiveReplicaError):
        pick_replica("prefix", {}, {}, load_penalty=0, turn=0)


# --- the router's view of the prefixes ------------------------------------------------
def addresses(tmp_path, *names):
    return {name: ReplicaAddress.ipc(tmp_path, name) for name in names}


def stored(prompt, *, salt=None, block_size=16):
    hashes = []
    BlockHasher(block_size).extend(hashes, prompt, ExtraKeys(cache_salt=salt))
    return WireBlockStored([external_hash(h) for h in hashes], None, [], block_size, None, "GPU", None)


def test_the_router_hashes_prompts_as_the_events_name_blocks(tmp_path):
    prompt = list(range(100))
    with Router(addresses(tmp_path, "a", "b")) as router:
        router.index.apply("a", [stored(prompt[:64])])
        router.index.apply("b", [stored(prompt[:32], salt="tenant")])
        assert router.cached_tokens([*prompt, 7]) == {"a": 64, "b": 0}
        assert router.cached_tokens(prompt, cache_salt="tenant") == {"a": 0, "b": 32}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "fastest"}, "policy must be one of"),
        ({"load_penalty": -1}, "load_penalty must be a finite number >= 0, got -1"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s must be > 0"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_router_settings_are_refused(tmp_path, kwargs, match):
    with pytest.raises(Exception, match=match):
        Router(addresses(tmp_path, "a"), **kwargs)


# --- a replica dies mid-trace ---------------------------------------------------------
def test_a_dead_replicas_requests_are_retried_elsewhere_and_its_prefixes_leave_the_index(tmp_path):
    interval = 0.5
    replicas = [ThreadReplica(tmp_path, name, interval) for name in ("a", "b")]
    prompts = [[t % 512 for t in range(i, i + 80)] for i in range(6)]
    try:
        with Router({r.name: r.address for r in replicas}, policy="round_robin") as router:
            router.wait_ready(120)
            first = [router.submit(p, 2) for p in prompts[:2]]
            done = []
            while len(done) < 2:
                done += router.poll(0.05)
            assert {o.request_id for o in done} == set(first)
            while not router.cached_tokens(prompts[1])["b"]:  # b's KV events are in
                router.poll(0.05)
            ids = [router.submit(p, 24) for p in prompts[2:]]
            on_b = router.in_flight("b")
            assert on_b == 2
            replicas[1].kill()
            while router.num_in_flight:
                done += router.poll(0.05)
            sent_to_b = router.num_sent("b")
            assert router.live_replicas == ("a",) and "b" in router.dropped_replicas
            later = [o for o in done if o.request_id in ids]
            assert len(later) == 4 and all(o.error is None and len(o.output_token_ids) == 24 for o in later)
            retried = [o for o in later if o.attempts == 2]
            assert len(retried) == on_b and all(o.replica == "a" for o in retried)
            assert router.num_retries == on_b
            assert not any(r == "b" for where in router.index.snapshot().values() for r, _ in where)
            assert router.cached_tokens(prompts[1]) == {"a": 0}
            router.submit(prompts[1], 1)
            while router.num_in_flight:
                router.poll(0.05)
            assert router.num_sent("b") == sent_to_b
    finally:
        for replica in replicas:
            replica.kill()


# --- every request answered exactly once ----------------------------------------------
def wait_all(router, ids, timeout_s=120.0):
    """Poll until every id in ``ids`` is answered; the answers by id (each exactly once)."""
    answers = {}
    deadline = time.monotonic() + timeout_s
    while set(answers) < set(ids):
        assert time.monotonic() < deadline, f"unanswered: {set(ids) - set(answers)}"
        for out in router.poll(0.05):
            assert out.request_id not in answers, f"{out.request_id} answered twice"
            answers[out.request_id] = out
    return answers


def test_when_the_last_replica_dies_its_requests_are_answered_with_no_live_replica(tmp_path):
    replica = ThreadReplica(tmp_path, "a", 0.2)
    try:
        with Router({"a": replica.address}, heartbeat_interval_s=0.2) as router:
            router.wait_ready(120)
            ids = [router.submit(list(range(1, 30)), 200) for _ in range(2)]
            replica.kill()
            answers = wait_all(router, ids)
            assert all(answers[i].error == "no live replica" for i in ids)
            later = router.submit([1, 2, 3], 2)
            assert wait_all(router, [later])[later].error == "no live replica"
    finally:
        replica.kill()


class FailingSends:
    """A request socket whose sends fail (a full queue), for a link under test."""

    def __init__(self, socket) -> None:
        self.socket = socket

    def send(self, *args, **kwargs):
        raise zmq.Again()

    def __getattr__(self, name):
        return getattr(self.socket, name)


def test_a_send_failing_mid_drop_moves_on_to_the_next_replica(tmp_path):
    replicas = [ThreadReplica(tmp_path, name, 0.5) for name in ("a", "b", "c")]
    try:
        with Router({r.name: r.address for r in replicas}, policy="round_robin") as router:
            router.wait_ready(120)
            ids = [router.submit(list(range(i, i + 20)), 30) for i in range(3)]
            assert router.in_flight("c") == 1
            link = router._links["b"]
            link.requests = FailingSends(link.requests)
            router.drop("c")
            link.requests = link.requests.socket
            answers = wait_all(router, ids)
            assert all(a.error is None for a in answers.values())
            assert answers[ids[2]].replica == "a" and router.num_send_failures >= 1
    finally:
        for replica in replicas:
            replica.kill()


def test_a_request_past_its_deadline_is_answered_and_cancelled(tmp_path):
    replica = ThreadReplica(tmp_path, "a", 0.5)
    try:
        with Router({"a": replica.address}) as router:
            router.wait_ready(120)
            slow = router.submit(list(range(1, 30)), 200, deadline_s=0.05)
            quick = router.submit([1, 2, 3], 2)
            answers = wait_all(router, [slow, quick])
            assert answers[slow].error == "deadline passed" and answers[quick].error is None
            cancelled = router.submit(list(range(1, 30)), 200)
            assert router.cancel(cancelled) and not router.cancel("unknown")
            assert wait_all(router, [cancelled])[cancelled].error == "cancelled"
    finally:
        replica.kill()


def test_a_hung_replica_is_dropped_its_requests_served_elsewhere_and_readmitted_when_it_recovers(tmp_path):
    replicas = [ThreadReplica(tmp_path, name, 0.2) for name in ("a", "b")]
    try:
        with Router(
            {r.name: r.address for r in replicas}, policy="round_robin", heartbeat_interval_s=0.2, hang_timeout_s=1.0
        ) as router:
            router.wait_ready(120)
            replicas[0].running.clear()  # a's step hangs; its heartbeat thread goes on
            rid = router.submit(list(range(1, 30)), 4)
            answer = wait_all(router, [rid])[rid]
            assert answer.error is None and answer.replica == "b" and answer.attempts == 2
            assert router.live_replicas == ("b",), "a still heartbeats but makes no progress"
            replicas[0].running.set()
            deadline = time.monotonic() + 30
            while router.live_replicas != ("a", "b"):
                assert time.monotonic() < deadline, "a recovered but was not re-admitted"
                router.poll(0.05)
            assert router.num_readmissions == 1
    finally:
        for replica in replicas:
            replica.kill()


def test_forged_and_malformed_answers_are_skipped_and_a_valid_one_kept(tmp_path):
    replica = ThreadReplica(tmp_path, "a", 0.5)
    fake = ReplicaAddress.ipc(tmp_path, "f")
    ctx = zmq.Context()
    forger = ctx.socket(zmq.ROUTER)
    forger.setsockopt(zmq.ROUTER_MANDATORY, 1)
    forger.bind(fake.requests)
    try:
        with Router({"a": replica.address, "f": fake}, policy="round_robin", heartbeat_interval_s=60) as router:
            rid = router.submit(list(range(1, 20)), 3)
            assert router.in_flight("a") == 1
            forged = msgspec.msgpack.encode(GenerateResult(rid, "a", [9, 9, 9], 0.0, 0))
            for frames in ([forged], [b"\xc1"], [forged, b"extra"]):
                while True:
                    try:
                        forger.send_multipart([router.router_id.encode(), *frames])
                        break
                    except zmq.ZMQError:  # the router's link has not connected yet
                        time.sleep(0.01)
            answer = wait_all(router, [rid])[rid]
            assert answer.replica == "a" and answer.output_token_ids != (9, 9, 9)
            assert router.num_bad_messages >= 2
    finally:
        forger.close(linger=0)
        ctx.term()
        replica.kill()


def test_routers_request_ids_differ_and_a_callers_id_may_not_be_reused_while_in_flight(tmp_path):
    with Router(addresses(tmp_path, "a")) as one, Router(addresses(tmp_path, "a")) as two:
        assert one.router_id != two.router_id
        assert one.submit([1, 2], 1).startswith(one.router_id)
        one.submit([1, 2], 1, request_id="mine")
        with pytest.raises(RouterError, match="not already in flight"):
            one.submit([1, 2], 1, request_id="mine")


def test_an_authenticated_replica_serves_a_router_with_the_keys_and_not_one_without(tmp_path):
    keys = CurveKeys.generate()
    replica = ThreadReplica(tmp_path, "a", 0.2, curve=keys)
    try:
        with (
            Router({"a": replica.address}, curve=CurveKeys.generate()) as stranger,
            pytest.raises(RouterError, match="sent no heartbeat"),
        ):
            stranger.wait_ready(1.0)
        with Router({"a": replica.address}, curve=keys) as router:
            router.wait_ready(120)
            rid = router.submit([1, 2, 3], 2)
            assert wait_all(router, [rid])[rid].error is None
    finally:
        replica.kill()


def test_a_silent_replay_socket_does_not_escape_the_router(tmp_path):
    fake = ReplicaAddress.ipc(tmp_path, "f")
    ctx = zmq.Context()
    sockets = {kind: ctx.socket(zmq.PUB if kind in ("heartbeats", "events") else zmq.ROUTER) for kind in vars(fake)}
    for kind, sock in sockets.items():
        sock.bind(getattr(fake, kind))
    beat = msgspec.msgpack.encode(Heartbeat("f", 0, 0))
    try:
        with Router({"f": fake}, heartbeat_interval_s=60) as router:
            deadline = time.monotonic() + 30
            while not router._links["f"].heard:
                assert time.monotonic() < deadline
                sockets["heartbeats"].send(beat)
                try:
                    router.wait_ready(0.2)
                except RouterError:
                    continue
            assert router.num_replay_timeouts == 1, "the mute replay socket timed out inside wait_ready"
            rid = router.submit([1, 2, 3], 1)
            assert sockets["requests"].poll(5000) and router.in_flight("f") == 1 and rid
    finally:
        for sock in sockets.values():
            sock.close(linger=0)
        ctx.term()


# --- replicas driven by hand --------------------------------------------------------------
class FakeReplicas:
    """A request ROUTER and a heartbeat PUB bound at each replica's address, driven by
    the test (no engine, no events): what the router sends, and answers it gets."""

    def __init__(self, tmp_path, *names: str) -> None:
        self.ctx = zmq.Context()
        self.addresses = addresses(tmp_path, *names)
        self.requests, self.heartbeats, self.monitors, self.clients = {}, {}, {}, {}
        for name, address in self.addresses.items():
            self.requests[name] = self.ctx.socket(zmq.ROUTER)
            self.monitors[name] = self.requests[name].get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self.requests[name].bind(address.requests)
            self.heartbeats[name] = self.ctx.socket(zmq.PUB)
            self.heartbeats[name].bind(address.heartbeats)
        self.decode = msgspec.msgpack.Decoder(ToReplica).decode

    def router(self, **kwargs) -> Router:
        """A router over these replicas, once every link is up and its heartbeats heard."""
        router = Router(self.addresses, heartbeat_interval_s=60, **kwargs)
        deadline = time.monotonic() + 30
        for name in self.addresses:
            assert self.monitors[name].poll(30_000), f"{name}: the router's link never came up"
            while not router._links[name].heard:
                assert time.monotonic() < deadline, f"{name}: the router hears no heartbeat"
                self.heartbeats[name].send(msgspec.msgpack.encode(Heartbeat(name, 0, 0)))
                router.poll(0.01)
        return router

    def received(self, name: str) -> list:
        """The messages ``name`` got since the last call (waiting up to 2 s for the first)."""
        out, wait_ms = [], 2000
        while self.requests[name].poll(wait_ms):
            self.clients[name], payload = self.requests[name].recv_multipart()
            out.append(self.decode(payload))
            wait_ms = 100
        return out

    def answer(self, name: str, message) -> None:
        """Send ``message`` to the client ``name`` last received from."""
        self.requests[name].send_multipart([self.clients[name], msgspec.msgpack.encode(message)])

    def close(self) -> None:
        for name in self.addresses:
            self.requests[name].disable_monitor()
        for sock in [*self.monitors.values(), *self.requests.values(), *self.heartbeats.values()]:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fakes(tmp_path):
    fakes = FakeReplicas(tmp_path, "a", "b")
    yield fakes
    fakes.close()


def test_a_prompt_follows_a_request_in_flight_that_computes_its_prefix_before_any_event_says_so(fakes):
    system = list(range(1, 65))
    with fakes.router() as router:
        first = router.submit([*system, 1, 2], 4)
        second = router.submit([*system, 3, 4], 4)
        other = router.submit(list(range(100, 170)), 4)
        on_a = [m.request_id for m in fakes.received("a")]
        on_b = [m.request_id for m in fakes.received("b")]
    assert sorted([on_a, on_b]) == sorted([[first, second], [other]]), "the system prompt is computed once"


def test_a_request_taken_from_a_replica_is_cancelled_on_it(fakes):
    with fakes.router(policy="round_robin") as router:
        rid = router.submit([1, 2, 3], 4)
        assert [m.request_id for m in fakes.received("a")] == [rid]
        router.drop("a")
        assert fakes.received("a") == [CancelRequest(rid)], "a stops computing what b now serves"
        assert [m.request_id for m in fakes.received("b")] == [rid]


def test_a_malformed_heartbeat_is_skipped_and_an_answer_of_the_same_poll_kept(fakes):
    with fakes.router(policy="round_robin") as router:
        rid = router.submit([1, 2, 3], 2)
        fakes.received("a")
        fakes.heartbeats["a"].send(b"\xc1")
        fakes.heartbeats["a"].send(msgspec.msgpack.encode(Heartbeat("b", 0, 0)))  # another replica's name
        fakes.answer("a", GenerateResult(rid, "a", [5, 6], 0.01, 0))
        time.sleep(0.2)
        answers = router.poll(1.0)
        assert [(a.request_id, a.output_token_ids) for a in answers] == [(rid, (5, 6))]
        assert router.num_bad_messages == 2 and router.live_replicas == ("a", "b")


def test_one_replay_request_past_the_buffer_does_not_take_a_replica_out_of_routing(tmp_path):
    """``b"\\xff" * 8`` on a replica's replay socket ended its replay thread; every router
    that then followed the replica waited 5 s for a replay on each live batch, read no
    heartbeat meanwhile, and dropped it: 20 of 20 requests were answered "no live replica"."""
    replica = ThreadReplica(tmp_path, "a", 0.2)
    ctx = zmq.Context()
    poison = ctx.socket(zmq.DEALER)
    poison.connect(replica.address.replay)
    try:
        with Router({"a": replica.address}, heartbeat_interval_s=0.2, hang_timeout_s=10) as router:
            router.wait_ready(120)
            poison.send_multipart([b"", b"\xff" * 8])
            poison.poll(5000)  # its end marker (before: nothing, the thread had ended)
            router._links["a"].events.resync()  # a router meeting the replica now
            rids = [router.submit([(i * 7 + t) % 512 for t in range(40)], 2) for i in range(10)]
            answers = wait_all(router, rids, timeout_s=60)
            assert all(o.error is None for o in answers.values()), {o.error for o in answers.values()}
            assert router.dropped_replicas == {} and router.num_replay_timeouts == 0
    finally:
        poison.close(linger=0)
        ctx.term()
        replica.kill()


def beat_until(fakes, router, name: str, beat: Heartbeat, heard) -> None:
    """Send ``beat`` from ``name`` until ``heard()`` holds on the router."""
    deadline = time.monotonic() + 10
    while not heard():
        assert time.monotonic() < deadline, f"{name}: the router never took {beat}"
        fakes.heartbeats[name].send(msgspec.msgpack.encode(beat))
        router.poll(0.02)


def test_a_prompt_over_every_replicas_limit_is_refused_at_once_naming_it(fakes):
    """One over-long prompt used to be sent, the replica's socket dropped the router's
    connection (MAXMSGSIZE), and other callers' requests crossing the reconnect waited
    for their deadline."""
    limits = {"a": 256, "b": 128}
    with fakes.router() as router:
        for name, limit in limits.items():
            beat = Heartbeat(name, 1, 0, max_model_len=limit, max_request_bytes=max_request_bytes(limit))
            beat_until(fakes, router, name, beat, lambda n=name: router._links[n].max_model_len)
        with pytest.raises(RouterError, match=r"30000 tokens \(\d+ bytes\) exceeds every live .* max_model_len=256"):
            router.submit([7] * 30_000, 2)
        with pytest.raises(RouterError, match="max_model_len=256"):
            router.submit(list(range(256)), 2)
        assert router.num_in_flight == 0, "nothing was sent"
        rids = [router.submit(list(range(200)), 2) for _ in range(2)]
        assert [m.request_id for m in fakes.received("a")] == rids, "only a admits 200 tokens"
        assert fakes.received("b") == []


def test_a_replica_stuck_while_idle_is_dropped_once_a_request_waits_on_it(fakes):
    """Liveness read only the replica's own ``busy``: a loop stuck while idle (heartbeat
    thread alive, never a step, never busy) kept its requests until their deadline."""
    with fakes.router(policy="round_robin", hang_timeout_s=0.5) as router:
        rid = router.submit([1, 2, 3], 2)
        assert [m.request_id for m in fakes.received("a")] == [rid]
        deadline = time.monotonic() + 10
        while router.live_replicas != ("b",):
            assert time.monotonic() < deadline, "the stuck replica was never dropped"
            for name in ("a", "b"):
                fakes.heartbeats[name].send(msgspec.msgpack.encode(Heartbeat(name, 1, 0, steps=5, busy=False)))
            router.poll(0.05)
        assert [m.request_id for m in fakes.received("b")] == [rid], "its request went to b"
        for _ in range(5):  # heard again, still without a step: it stays out
            fakes.heartbeats["a"].send(msgspec.msgpack.encode(Heartbeat("a", 2, 0, steps=5)))
            router.poll(0.05)
        assert router.live_replicas == ("b",)
        beat_until(fakes, router, "a", Heartbeat("a", 3, 0, steps=6), lambda: "a" in router.live_replicas)
        assert router.num_readmissions == 1


def test_a_replica_compiling_past_the_hang_timeout_stays_live_and_is_dropped_once_it_stalls(fakes):
    """A replica whose first step compiled for longer than ``hang_timeout_s`` (no step
    counted meanwhile) was dropped as hung (issue 42): beats that say it is compiling
    are progress; once they stop saying so, the stall is a hang again."""
    with fakes.router(policy="round_robin", hang_timeout_s=0.5) as router:
        rid = router.submit([1, 2, 3], 2)
        assert [m.request_id for m in fakes.received("a")] == [rid]
        end = time.monotonic() + 1.5  # three hang timeouts of compiling, no step
        while time.monotonic() < end:
            for name in ("a", "b"):
                beat = Heartbeat(name, 1, 0, steps=5, busy=True, compiling=name == "a")
                fakes.heartbeats[name].send(msgspec.msgpack.encode(beat))
            router.poll(0.05)
        assert router.live_replicas == ("a", "b") and router.in_flight("a") == 1, "compiling is alive"
        deadline = time.monotonic() + 10
        while router.live_replicas != ("b",):
            assert time.monotonic() < deadline, "a replica stalled outside a compile was never dropped"
            for name in ("a", "b"):
                fakes.heartbeats[name].send(msgspec.msgpack.encode(Heartbeat(name, 1, 0, steps=5, busy=True)))
            router.poll(0.05)
        assert [m.request_id for m in fakes.received("b")] == [rid], "its request went to b"


def test_a_replica_restarted_between_two_heartbeats_gets_its_requests_again_and_a_fresh_index(tmp_path):
    """A new ``instance`` in a replica's heartbeats was not read as a restart: its
    request in flight waited for its deadline, and the dead cache's blocks stayed in
    the index."""
    replica = ThreadReplica(tmp_path, "a", 0.2)
    cached, lost = [(3 * t) % 512 for t in range(70)], [(5 * t) % 512 for t in range(40)]
    try:
        with Router({"a": replica.address}, heartbeat_interval_s=30, request_timeout_s=120) as router:
            router.wait_ready(120)
            wait_all(router, [router.submit(cached, 2)])
            while router.cached_tokens(cached)["a"] < 64:
                router.poll(0.05)
            instance = router._links["a"].instance
            replica.running.clear()  # its step hangs: the request is in flight when it dies
            rid = router.submit(lost, 4)
            time.sleep(0.5)
            replica.kill()
            replica = ThreadReplica(tmp_path, "a", 0.2)
            [out] = wait_all(router, [rid], timeout_s=60).values()
            assert out.error is None and len(out.output_token_ids) == 4 and out.attempts == 2
            assert router._links["a"].instance != instance and router.num_restarts == 1
            assert router.live_replicas == ("a",) and router.num_readmissions == 0, "never dropped"
            assert router.cached_tokens(cached)["a"] == 0, "the dead cache's blocks left the index"
    finally:
        replica.kill()


# --- a short soak (scripts/soak_route.py runs the long one over processes) -----------------
@pytest.mark.slow
def test_a_short_soak_answers_every_request_once_and_leaks_nothing(tmp_path):
    """Two routers over three replicas, 240 requests: one replica killed and restarted on
    its addresses (a new publisher), one hung then recovered, hostile frames throughout."""
    keys = CurveKeys.generate()
    replicas = {name: ThreadReplica(tmp_path, name, 0.2, curve=keys) for name in ("a", "b", "c")}
    secure = SecureContext(keys)
    hostile = [secure.connect(zmq.DEALER, "requests", r.address.requests) for r in replicas.values()]
    frames = [[b"hello", b"world"], [b"\xc1"], [b"x" * (max_request_bytes(256) + 1)], [b"\x93\x01"]]
    routers = []
    try:
        for _ in range(2):
            routers.append(
                Router(
                    {n: r.address for n, r in replicas.items()},
                    heartbeat_interval_s=0.2,
                    hang_timeout_s=1.0,
                    request_timeout_s=60,
                    curve=keys,
                )
            )
            routers[-1].wait_ready(120)
        rng = np.random.default_rng(0)
        systems = [rng.integers(0, 512, 48).tolist() for _ in range(4)]
        answers, submitted, sent = [{}, {}], [set(), set()], 0
        events = {60: "kill c", 90: "restart c", 130: "hang b", 170: "recover b"}
        deadline = time.monotonic() + 240
        while sent < 240 or any(len(a) < len(s) for a, s in zip(answers, submitted, strict=True)):
            assert time.monotonic() < deadline, "the soak did not finish"
            for i, router in enumerate(routers):
                while sent < 240 and len(submitted[i]) - len(answers[i]) < 6:
                    prompt = systems[sent % 4] + rng.integers(0, 512, int(rng.integers(4, 30))).tolist()
                    submitted[i].add(router.submit(prompt, 3))
                    sent += 1
                    what = events.pop(sent, None)
                    if what == "kill c":
                        replicas["c"].kill()
                    elif what == "restart c":
                        replicas["c"] = ThreadReplica(tmp_path, "c", 0.2, curve=keys)
                    elif what == "hang b":
                        replicas["b"].running.clear()
                    elif what == "recover b":
                        replicas["b"].running.set()
                    hostile[sent % 3].send_multipart(frames[sent % 4], zmq.NOBLOCK)
                for out in router.poll(0.01):
                    assert out.request_id not in answers[i], "answered twice"
                    answers[i][out.request_id] = out
        assert [set(a) for a in answers] == submitted
        outputs = [o for a in answers for o in a.values()]
        assert sum(o.error is None for o in outputs) >= 200, {o.error for o in outputs}
        assert sum(r.num_readmissions for r in routers) >= 2, "c came back and b recovered"
        settle = time.monotonic() + 1.0  # the cancels reach the replicas
        while time.monotonic() < settle:
            for router in routers:
                assert router.poll(0.01) == []
    finally:
        for sock in hostile:
            sock.close(linger=0)
        secure.term()
        for router in routers:
            router.close()
        for replica in replicas.values():
            replica.stop()
    for replica in replicas.values():
        assert replica.unfinished == 0 and replica.audit == CacheAudit(0, 0), (replica.name, replica.audit)


def test_past_its_free_slots_a_cached_replica_loses_to_the_expected_wait():
    assert queue_tokens(3, 4, 128, 16) == 0, "a free slot: the request starts at once"
    assert queue_tokens(4, 4, 128, 16) == 512, "one to finish first: 4 decode steps of 128 tokens' worth"
    assert queue_tokens(9, 0, 128, 16) == 0, "slots unknown: no wait counted"
    loads, cached = {"a": 4, "b": 0}, {"a": 300, "b": 128}
    queued = {"a": queue_tokens(4, 4, 128, 16), "b": 0.0}
    assert pick_replica("prefix", loads, cached, load_penalty=16, turn=0) == "a"
    assert pick_replica("prefix", loads, cached, load_penalty=16, turn=0, queued=queued) == "b"
