"""A replica: an Engine behind a ZeroMQ endpoint answers with the tokens Engine.generate
gives, takes requests while others run, refuses bad ones without stopping, and
publishes the KV events and heartbeats a router follows."""

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
    max_request_bytes,
)
from jaxkv.fleet.replica import ReplicaError, ReplicaSpec  # noqa: E402
from jaxkv.fleet.router import Router  # noqa: E402
from jaxkv.serving.engine import Engine  # noqa: E402
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


def test_multi_frame_and_oversized_messages_are_skipped_and_the_replica_goes_on(replica):
    hostile, client = Client(replica.address), Client(replica.address)
    try:
        hostile.sock.send_multipart([b"hello", b"world"])
        hostile.sock.send(b"x" * (max_request_bytes(ENGINE["max_model_len"]) + 1))  # dropped before decoding
        client.send(GenerateRequest("after", [1, 2, 3], 2))
        [answer] = client.answers(1)
        assert isinstance(answer, GenerateResult) and answer.request_id == "after"
        assert hostile.answers(1, wait_ms=300) == [], "nothing answers a message it cannot name"
    finally:
        hostile.close()
        client.close()


def test_two_clients_may_use_the_same_request_id(replica):
    one, two = Client(replica.address), Client(replica.address)
    try:
        one.send(GenerateRequest("route-0", [1, 2, 3], 3))
        two.send(GenerateRequest("route-0", [4, 5, 6, 7], 2))
        [a], [b] = one.answers(1), two.answers(1)
    finally:
        one.close()
        two.close()
    assert isinstance(a, GenerateResult) and len(a.output_token_ids) == 3
    assert isinstance(b, GenerateResult) and len(b.output_token_ids) == 2


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


def test_heartbeats_carry_the_replica_name_and_count(replica):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(replica.address.heartbeats)
    try:
        beats = [msgspec.msgpack.decode(sub.recv(), type=Heartbeat) for _ in range(2)]
    finally:
        sub.close(linger=0)
        ctx.term()
    assert [b.replica for b in beats] == ["r0", "r0"] and beats[1].seq == beats[0].seq + 1
    assert beats[0].load == 0 and not beats[0].busy and beats[0].instance == beats[1].instance


def test_bad_replica_settings_are_refused(tmp_path):
    address = ReplicaAddress.ipc(tmp_path, "r")
    with pytest.raises(SocketSecurityError, match="requests must be a str starting with"):
        ReplicaAddress("http://x", address.heartbeats, address.events, address.replay)
    with pytest.raises(ReplicaError, match="heartbeat_interval_s must be a positive number, got 0"):
        ReplicaSpec("r", address, ENGINE, 0)
    with pytest.raises(ReplicaError, match="name must be a non-empty str"):
        ReplicaSpec("", address, ENGINE)
    spec = ReplicaSpec("r", address, ENGINE, 0.5)
    assert ReplicaSpec.from_json(spec.to_json()) == spec


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
