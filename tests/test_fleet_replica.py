"""A replica: an Engine behind a ZeroMQ endpoint answers with the tokens Engine.generate
gives, takes requests while others run, refuses bad ones without stopping, and
publishes the KV events and heartbeats a router follows."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from thread_replicas import ENGINE, ThreadReplica  # noqa: E402

from jaxkv.fleet.protocol import (  # noqa: E402
    CancelRequest,
    FromReplica,
    GenerateFailure,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    ReplicaAddress,
    max_frame_bytes,
    max_request_bytes,
)
from jaxkv.fleet.replica import Replica, ReplicaError, ReplicaSpec, thread_is_compiling  # noqa: E402
from jaxkv.fleet.router import Router  # noqa: E402
from jaxkv.serving.engine import CacheAudit, Engine  # noqa: E402
from jaxkv.serving.kv_events import KVEventPublisher  # noqa: E402
from jaxkv.serving.zmq_security import SocketSecurityError  # noqa: E402


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """One replica serving in a thread of this process."""
    replica = ThreadReplica(tmp_path_factory.mktemp("replica"), "r0", 0.2)
    yield replica.spec
    replica.kill()


def prompts():
    shared = [(7 * t) % 512 for t in range(40)]
    return [[*shared, 1, 2, 3], shared + list(range(90, 150)), list(range(300, 321)), [*shared, 5]]


def test_a_replica_answers_with_the_tokens_of_engine_generate(replica):
    expected = Engine.build(**ENGINE).generate(prompts(), 8).outputs
    with Router({"r0": replica.address}) as router:
        router.wait_ready(120)
        ids = [router.submit(prompts()[0], 8)]
        answers = []
        while not answers:  # the first request runs, the others arrive while it does
            answers += router.poll(0.01)
            if len(ids) < len(prompts()):
                ids.append(router.submit(prompts()[len(ids)], 8))
        while router.num_in_flight:
            answers += router.poll(0.05)
    by_id = {a.request_id: a for a in answers}
    assert [list(by_id[i].output_token_ids) for i in ids] == [list(o.output_token_ids) for o in expected]
    assert all(a.replica == "r0" and a.error is None and a.ttft_s > 0 for a in answers)


def test_the_router_counts_the_cached_prefix_the_replica_hits(replica):
    prompt = [(11 * t) % 512 for t in range(70)]
    with Router({"r0": replica.address}) as router:
        router.wait_ready(120)
        router.submit(prompt, 2)
        while router.num_in_flight:
            router.poll(0.05)
        while router.cached_tokens([*prompt, 1])["r0"] < 64:  # the events of the first request
            router.poll(0.05)
        again = router.cached_tokens([*prompt, 1])["r0"]
        router.submit([*prompt, 1], 2)
        answers = []
        while not answers:
            answers += router.poll(0.05)
    assert again == answers[0].num_cached_tokens == 64


def test_a_bad_request_is_refused_and_the_replica_goes_on(replica):
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.connect(replica.address.requests)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.Decoder(FromReplica).decode
    try:
        client.send(encode(GenerateRequest("bad", [0, 600], 2)))
        client.send(b"not msgpack")
        client.send(encode(GenerateRequest("good", [1, 2, 3], 2)))
        answers = [decode(client.recv()) for _ in range(3)]
    finally:
        client.close(linger=0)
        ctx.term()
    bad, garbled, good = answers
    assert isinstance(bad, GenerateFailure) and "token 600 is not an id in [0, 512)" in bad.message
    assert isinstance(garbled, GenerateFailure) and "undecodable" in garbled.message
    assert isinstance(good, GenerateResult) and len(good.output_token_ids) == 2


class Client:
    """A plain DEALER on the replica's request socket (a router, or a hostile client)."""

    def __init__(self, address: ReplicaAddress) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address.requests)
        self.decode = msgspec.msgpack.Decoder(FromReplica).decode

    def send(self, message) -> None:
        self.sock.send(msgspec.msgpack.encode(message))

    def answers(self, n: int, wait_ms: int = 60_000) -> list:
        out = []
        while len(out) < n and self.sock.poll(wait_ms):
            out.append(self.decode(self.sock.recv()))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def assert_served_after(client: Client, hostile: Client, *, wait_ms: int) -> None:
    """The replica goes on: it answers the next client's request, and nothing to the
    hostile one (it cannot name, or never read, what that one sent)."""
    client.send(GenerateRequest("after", [1, 2, 3], 2))
    [answer] = client.answers(1)
    assert isinstance(answer, GenerateResult) and answer.request_id == "after"
    assert hostile.answers(1, wait_ms=wait_ms) == []


def test_a_multi_frame_message_is_skipped_and_the_replica_goes_on(replica):
    hostile, client = Client(replica.address), Client(replica.address)
    try:
        hostile.sock.send_multipart([b"hello", b"world"])  # raised out of the serving loop, ending the replica
        assert_served_after(client, hostile, wait_ms=300)
    finally:
        hostile.close()
        client.close()


def test_a_request_over_the_size_limit_is_answered_with_the_limit_and_the_connection_kept(replica):
    """A frame over max_request_bytes was dropped by ZeroMQ (MAXMSGSIZE) with the
    client's connection: a router lost the requests crossing its reconnect. It is now
    answered with a failure naming the limit (its prompt never decoded), on the same
    connection, which serves the next request; only a frame past the socket's own
    limit (4x) still drops the connection, and a 10x one is never decoded."""
    client, hostile = Client(replica.address), Client(replica.address)
    limit = max_request_bytes(ENGINE["max_model_len"])
    try:
        client.send(GenerateRequest("long", list(range(1, 512)) * 60, 2))  # ~76 KB, over 67,840 bytes
        client.sock.send(b"x" * (limit + 1))
        client.send(GenerateRequest("after", [1, 2, 3], 2))
        answers = client.answers(3, wait_ms=5000)
        words = f"exceeds max_request_bytes={limit} (max_model_len=256)"
        assert len(answers) == 3, answers
        long, junk, after = answers
        assert isinstance(long, GenerateFailure) and long.request_id == "long" and words in long.message, long
        assert isinstance(junk, GenerateFailure) and junk.request_id == "" and words in junk.message, junk
        assert isinstance(after, GenerateResult) and after.request_id == "after"
        hostile.send(GenerateRequest("huge", [1] * (10 * limit), 2))
        hostile.sock.send(b"x" * (max_frame_bytes(ENGINE["max_model_len"]) + 1))
        client.send(GenerateRequest("next", [1, 2, 3], 2))
        assert [a.request_id for a in client.answers(1)] == ["next"] and hostile.answers(1, wait_ms=500) == []
    finally:
        hostile.close()
        client.close()


def test_heartbeats_announce_the_request_limits(replica):
    beat = heartbeat(replica.address)
    assert (beat.max_model_len, beat.max_request_bytes) == (256, max_request_bytes(256))


def test_two_clients_may_use_the_same_request_id(replica):
    one, two = Client(replica.address), Client(replica.address)
    try:
        for client, rid in ((one, "hello-1"), (two, "hello-2")):  # both connected and served
            client.send(GenerateRequest(rid, [1, 2], 1))
            assert [a.request_id for a in client.answers(1)] == [rid]
        one.send(GenerateRequest("route-0", [1, 2, 3], 40))  # still running when the other arrives
        two.send(GenerateRequest("route-0", [4, 5, 6, 7], 2))
        [b], [a] = two.answers(1), one.answers(1)
    finally:
        one.close()
        two.close()
    assert isinstance(b, GenerateResult) and len(b.output_token_ids) == 2, b
    assert isinstance(a, GenerateResult) and len(a.output_token_ids) == 40, a


def test_a_cancelled_request_is_not_answered_and_the_next_one_is(replica):
    client = Client(replica.address)
    try:
        client.send(GenerateRequest("long", list(range(1, 40)), 200))
        client.send(CancelRequest("long"))
        client.send(GenerateRequest("short", [1, 2, 3], 2))
        answers = client.answers(2, wait_ms=3000)
    finally:
        client.close()
    assert [a.request_id for a in answers] == ["short"]


def heartbeat(address: ReplicaAddress) -> Heartbeat:
    """The next heartbeat of the replica at ``address``."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address.heartbeats)
    try:
        assert sub.poll(120_000), "no heartbeat"  # the first waits for the replica's warm-up
        return msgspec.msgpack.decode(sub.recv(), type=Heartbeat)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_heartbeats_carry_the_replica_name_and_count(replica):
    beats = [heartbeat(replica.address)]
    while beats[-1].seq == beats[0].seq:
        beats.append(heartbeat(replica.address))
    beats = [beats[0], beats[-1]]
    assert [b.replica for b in beats] == ["r0", "r0"] and beats[1].seq > beats[0].seq
    assert beats[0].load == 0 and not beats[0].busy and beats[0].instance == beats[1].instance


def test_bad_replica_settings_are_refused(tmp_path):
    address = ReplicaAddress.ipc(tmp_path, "r")
    with pytest.raises(SocketSecurityError, match="requests must be a str starting with"):
        ReplicaAddress("http://x", address.heartbeats, address.events, address.replay)
    with pytest.raises(ReplicaError, match="heartbeat_interval_s must be a positive number, got 0"):
        ReplicaSpec("r", address, ENGINE, 0)
    with pytest.raises(ReplicaError, match="name must be a non-empty str"):
        ReplicaSpec("", address, ENGINE)
    with pytest.raises(ReplicaError, match="include_token_ids must be a bool, got 'yes'"):
        ReplicaSpec("r", address, ENGINE, 0.5, "yes")  # type: ignore[arg-type]
    spec = ReplicaSpec("r", address, ENGINE, 0.5)
    assert ReplicaSpec.from_json(spec.to_json()) == spec


def test_a_replica_publishes_token_ids_by_default_and_leaves_them_out_when_asked(tmp_path):
    """Replicas left token ids out by default, which Dynamo's indexer and vllm-router's
    kv_aware policy need (issue 42): the default is now vLLM's."""
    spec = ReplicaSpec("r", ReplicaAddress.ipc(tmp_path, "r"), ENGINE)
    with spec.publisher() as publisher:
        assert publisher.include_token_ids is True
    without = dataclasses.replace(spec, include_token_ids=False)
    assert ReplicaSpec.from_json(without.to_json()) == without
    with without.publisher() as publisher:
        assert publisher.include_token_ids is False


def test_past_the_waiting_bound_a_request_is_refused_and_every_request_is_answered_once(replica):
    client = Client(replica.address)
    try:
        for i in range(40):
            client.send(GenerateRequest(f"q{i}", [1 + i % 7, 2, 3], 20))
        answers = client.answers(40)
    finally:
        client.close()
    assert sorted(a.request_id for a in answers) == sorted(f"q{i}" for i in range(40))
    refused = [a for a in answers if isinstance(a, GenerateFailure)]
    assert refused and all("requests already waiting" in a.message for a in refused)


def test_binding_an_ipc_path_a_live_socket_holds_is_refused(replica):
    spec = ReplicaSpec("r1", replica.address, ENGINE)
    with pytest.raises(SocketSecurityError, match="a live socket already holds this path"):
        KVEventPublisher(spec.address.events)


# --- a refusal leaves nothing behind ----------------------------------------------------
class InThisThread:
    """A replica (waiting bound 2) served in the test's own thread until a condition
    holds, so the test reads its engine between refusals."""

    def __init__(self, directory) -> None:
        self.engine = Engine.build(**ENGINE)
        self.address = ReplicaAddress.ipc(directory, "local")
        self.replica = Replica("local", self.engine, self.address, heartbeat_interval_s=60, max_waiting=2)
        self.client = Client(self.address)

    def serve_until(self, condition, timeout_s: float = 60.0) -> list:
        """Serve until ``condition(answers)`` holds; the answers that came back meanwhile."""
        answers: list = []
        deadline = time.monotonic() + timeout_s

        def done() -> bool:
            answers.extend(self.client.answers(100, wait_ms=0))
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s; answers {answers}"
            return condition(answers)

        self.replica.serve(done)
        return answers

    def serve(self, num_answers: int) -> list:
        """Serve until ``num_answers`` answers came back and the engine is idle."""
        return self.serve_until(lambda answers: len(answers) >= num_answers and not self.engine.has_unfinished)

    def close(self) -> None:
        self.client.close()
        self.replica.close()


PROBE = [(13 * t) % 512 for t in range(70)]
"""A prompt whose 64 leading tokens every refused request shares (4 cached blocks)."""


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    local = InThisThread(tmp_path_factory.mktemp("local"))
    local.client.send(GenerateRequest("probe", PROBE, 6))
    [first] = local.serve(1)
    local.probe_tokens = first.output_token_ids
    yield local
    local.close()


def refuse_over_the_waiting_bound(local: InThisThread) -> None:
    for i in range(6):  # taken in one receive: 2 wait, the others are refused
        local.client.send(GenerateRequest(f"w{i}", [*PROBE[:64], i], 8))
    answers = local.serve(6)
    refused = [a for a in answers if isinstance(a, GenerateFailure)]
    assert refused and all("already waiting" in a.message for a in refused)


def refuse_bad_input(local: InThisThread) -> None:
    local.client.send(GenerateRequest("bad-token", [*PROBE[:64], 600], 4))
    local.client.send(GenerateRequest("too-long", PROBE * 4, 4))
    local.client.send(GenerateRequest("no-tokens", [*PROBE[:64], 1], 0))
    answers = local.serve(3)
    assert len(answers) == 3 and all(isinstance(a, GenerateFailure) for a in answers), answers


def refuse_a_duplicate_id(local: InThisThread) -> None:
    local.client.send(GenerateRequest("twice", [*PROBE[:64], 1, 2], 4))
    local.client.send(GenerateRequest("twice", [*PROBE[:64], 3, 4], 4))
    answers = local.serve(2)
    assert any(isinstance(a, GenerateFailure) and "already in flight" in a.message for a in answers)


def refuse_frames_it_cannot_read(local: InThisThread) -> None:
    hostile = Client(local.address)
    try:
        bad = local.replica.num_bad_messages
        hostile.sock.send_multipart([b"hello", b"world"])
        hostile.sock.send(b"not msgpack")
        huge = [*PROBE, *range(max_request_bytes(ENGINE["max_model_len"]))]
        hostile.send(GenerateRequest("huge", huge, 4))  # never read: over MAXMSGSIZE
        local.serve_until(lambda _: local.replica.num_bad_messages >= bad + 2)
        assert local.serve_until(lambda _: True) == [] and not local.engine.has_unfinished
    finally:
        hostile.close()


def cancel_while_waiting(local: InThisThread) -> None:
    for i in range(5):
        local.client.send(GenerateRequest(f"c{i}", [*PROBE[:64], 7, i], 30))
        local.serve_until(lambda _, n=i + 1: local.engine.num_running + local.engine.num_waiting == n)
    assert local.engine.num_waiting == 1, "4 running slots"
    local.client.send(CancelRequest("c4"))
    answers = local.serve(4)
    assert sorted(a.request_id for a in answers) == ["c0", "c1", "c2", "c3"]


def computed(local: InThisThread, request_id: str) -> int:
    """Tokens the engine computed of a client's request (its id is kept per client)."""
    [seq] = [r.seq for key, r in local.engine._outputs.live.items() if key.endswith(f":{request_id}")]
    return seq.request.num_computed_tokens


def cancel_mid_prefill_and_mid_decode(local: InThisThread) -> None:
    local.client.send(GenerateRequest("long-output", [*PROBE[:64], 9], 100))
    local.client.send(GenerateRequest("long-prompt", [*PROBE[:64], *range(150)], 4))
    local.serve_until(lambda _: local.engine.num_running == 2 and computed(local, "long-prompt") > 128)
    assert computed(local, "long-prompt") < 214 and computed(local, "long-output") > 65, "mid-prefill, mid-decode"
    local.client.send(CancelRequest("long-prompt"))
    local.client.send(CancelRequest("long-output"))
    assert local.serve_until(lambda _: not local.engine.has_unfinished) == []


@pytest.mark.parametrize(
    "refusal",
    [
        refuse_over_the_waiting_bound,
        refuse_bad_input,
        refuse_a_duplicate_id,
        refuse_frames_it_cannot_read,
        cancel_while_waiting,
        cancel_mid_prefill_and_mid_decode,
    ],
)
def test_a_refused_or_cancelled_request_leaves_every_block_free_and_the_prefix_cache_exact(local, refusal):
    """A router cancels a request past its deadline or moved elsewhere (CancelRequest):
    the cancels stand for those too."""
    free = local.engine.manager.num_free_blocks
    refusal(local)
    assert local.engine.manager.num_requests == 0
    assert local.engine.audit() == CacheAudit(0, 0) and local.engine.manager.num_free_blocks == free
    local.client.send(GenerateRequest("probe", PROBE, 6))
    [again] = local.serve(1)
    assert again.output_token_ids == local.probe_tokens and again.num_cached_tokens == 64


def test_a_flood_is_taken_a_bounded_number_of_messages_between_two_steps(local):
    """30,000 sends used to be drained in one go (29,648 waiting) and starved stepping."""
    for i in range(30):
        local.client.send(GenerateRequest(f"f{i}", [*PROBE[:64], i], 2))
    time.sleep(0.3)  # all of them arrived
    loops = []
    answers = local.serve_until(lambda _: loops.append(0) or len(loops) > 1)  # one loop: a receive, a step
    time.sleep(0.1)
    answers += local.client.answers(30, wait_ms=0)
    taken = len(answers) + local.engine.num_running + local.engine.num_waiting
    assert taken == local.replica.max_receive == 2 * ENGINE["max_num_seqs"]
    answers += local.serve(30 - len(answers))
    assert sorted(a.request_id for a in answers) == sorted(f"f{i}" for i in range(30))
    assert local.engine.audit() == CacheAudit(0, 0)


def test_a_thread_is_compiling_while_jax_traces_its_step_and_not_while_it_waits():
    """Heartbeats say whether the serving thread is inside JAX's tracing, lowering or
    compiling (issue 42: a first step compiling past the hang timeout was dropped);
    checked against jax's own frames, from inside a trace."""
    seen = []

    def body(x):
        seen.append(thread_is_compiling(threading.get_ident()))
        return x + 1

    jax.jit(body)(jnp.zeros(3))
    assert seen == [True], "tracing a jitted function is compiling"
    done = threading.Event()
    waiter = threading.Thread(target=done.wait)
    waiter.start()
    try:
        assert thread_is_compiling(waiter.ident) is False
    finally:
        done.set()
        waiter.join()
    assert thread_is_compiling(waiter.ident) is False, "a thread that is gone"
