"""A replica: an Engine behind a ZeroMQ endpoint answers with the tokens Engine.generate
gives, takes requests while others run, refuses bad ones without stopping, and
publishes the KV events and heartbeats a router follows."""

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from thread_replicas import ENGINE, ThreadReplica  # noqa: E402

from jaxkv.fleet.protocol import (  # noqa: E402
    FromReplica,
    GenerateFailure,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    ReplicaAddress,
)
from jaxkv.fleet.replica import ReplicaError, ReplicaSpec  # noqa: E402
from jaxkv.fleet.router import Router  # noqa: E402
from jaxkv.serving.engine import Engine  # noqa: E402
from jaxkv.serving.kv_events import KVEventsError  # noqa: E402


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """One replica serving in a thread of this process."""
    replica = ThreadReplica(tmp_path_factory.mktemp("replica"), "r0", 0.2)
    yield replica.spec
    replica.kill()


def prompts():
    shared = [(7 * t) % 512 for t in range(40)]
    return [shared + [1, 2, 3], shared + list(range(90, 150)), list(range(300, 321)), shared + [5]]


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
        while router.cached_tokens(prompt + [1])["r0"] < 64:  # the events of the first request
            router.poll(0.05)
        again = router.cached_tokens(prompt + [1])["r0"]
        router.submit(prompt + [1], 2)
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
    assert beats[0].load == 0


def test_bad_replica_settings_are_refused(tmp_path):
    address = ReplicaAddress.ipc(tmp_path, "r")
    with pytest.raises(KVEventsError, match="requests must be a str starting with"):
        ReplicaAddress("http://x", address.heartbeats, address.events, address.replay)
    with pytest.raises(ReplicaError, match="heartbeat_interval_s must be a positive number, got 0"):
        ReplicaSpec("r", address, ENGINE, 0)
    with pytest.raises(ReplicaError, match="name must be a non-empty str"):
        ReplicaSpec("", address, ENGINE)
    spec = ReplicaSpec("r", address, ENGINE, 0.5)
    assert ReplicaSpec.from_json(spec.to_json()) == spec
