"""KV events on the wire: what a jaxkv Engine publishes decodes with a decoder written
against vLLM's schema, frames and replay answer as vLLM's publisher does."""

import subprocess
import sys
import time

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from script_runs import run_python_without  # noqa: E402
from vllm_event_schema import BlockStored, KVEventBatch  # noqa: E402

from jaxkv.core import pool  # noqa: E402
from jaxkv.core.manager import Request  # noqa: E402
from jaxkv.device.metadata import Buckets  # noqa: E402
from jaxkv.offload.catalog import KeysRemoved, KeysStored  # noqa: E402
from jaxkv.planner import plan_kv_cache  # noqa: E402
from jaxkv.presets import get_preset  # noqa: E402
from jaxkv.serving.engine import Engine  # noqa: E402
from jaxkv.serving.kv_events import (  # noqa: E402
    KVEventPublisher,
    KVEventsError,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEventBatch,
    external_hash,
    wire_events,
)
from jaxkv.serving.offload_connector import OffloadConfig  # noqa: E402
from jaxkv.serving.zmq_security import CurveKeys, SocketSecurityError  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_MS = 10_000
END = (-1).to_bytes(8, "big", signed=True)


VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# --- helpers -----------------------------------------------------------------------
def engine(publisher: KVEventPublisher) -> Engine:
    """tiny-llama on 31 usable blocks (evictions happen) with a 16-block host tier written through."""
    return Engine.build(
        "tiny-llama",
        memory_bytes=2 << 20,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        buckets=Buckets((64,), (4,), (16,)),
        offload=OffloadConfig(1 << 20, store="write_through"),
        kv_events=publisher,
    )


def prompt_rounds(seed: int = 0) -> list[list[list[int]]]:
    """Three rounds of four prompts: a shared 40-token prefix, then unrelated ones twice."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 512, 40).tolist()
    first = [shared + rng.integers(0, 512, n).tolist() for n in (10, 30, 50, 70)]
    return [first, *([rng.integers(0, 512, 60).tolist() for _ in range(4)] for _ in range(2))]


def replay(endpoint: str, start: int, topic: bytes = b"", read_after_s: float = 0.0) -> list[tuple[bytes, bytes]]:
    """vLLM's replay protocol from a plain DEALER: every (seq, payload) answered, end marker
    included; reading starts ``read_after_s`` after the request (a slow client)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        time.sleep(read_after_s)
        frames = []
        while True:
            assert sock.poll(WAIT_MS), "no replay answer"
            delimiter, frame_topic, seq, payload = sock.recv_multipart()
            assert delimiter == b"" and frame_topic == (b"" if seq == END else topic)
            frames.append((seq, payload))
            if seq == END:
                return frames
    finally:
        sock.close(linger=0)
        ctx.term()


def stored(group: int, hashes: tuple[bytes, ...], parent: bytes | None = None) -> pool.BlockStored:
    return pool.BlockStored(group, hashes, parent, 16, tuple(range(16 * len(hashes))), None)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# --- an engine run, read live and through replay --------------------------------------
@pytest.fixture(scope="module")
def engine_run():
    """Two generate calls published with a raw SUB listening; the published batches
    (through replay), the live frames, and the engine's first-round prompt hashes."""
    ctx = zmq.Context()
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, topic="kv") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        eng = engine(pub)
        rounds = prompt_rounds()
        for prompts in rounds[:2]:
            eng.generate(prompts, 8)
        live = []
        while sub.poll(1000 if not live else 0):
            live.append(sub.recv_multipart())
        replayed = replay(pub.replay_endpoint, 0, b"kv")
        req = Request("probe", rounds[0][0])
        first_hashes = eng.manager.hashes_per_group(req)[0]
        num_published = pub.num_published
    sub.close(linger=0)
    ctx.term()
    return {
        "live": live,
        "replayed": replayed,
        "first_hashes": first_hashes,
        "num_published": num_published,
    }


def test_every_batch_is_replayed_in_order_then_the_end_marker(engine_run):
    replayed = engine_run["replayed"]
    assert replayed[-1] == (END, b""), "vLLM's end marker: -1 and an empty payload frame"
    seqs = [int.from_bytes(seq, "big") for seq, _ in replayed[:-1]]
    assert seqs == list(range(engine_run["num_published"])) and seqs, "numbered from 0, as vLLM does"


def test_live_frames_are_topic_sequence_payload_and_match_the_replay(engine_run):
    by_seq = {int.from_bytes(seq, "big"): payload for seq, payload in engine_run["replayed"][:-1]}
    assert engine_run["live"], "the subscriber heard nothing live"
    for frames in engine_run["live"]:
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8
        assert by_seq[int.from_bytes(seq, "big")] == payload


def test_the_batches_decode_with_vllms_schema(engine_run):
    payloads = [payload for _, payload in engine_run["replayed"][:-1]]
    batches = [VLLM_DECODER.decode(payload) for payload in payloads]
    assert [msgspec.msgpack.encode(b) for b in batches] == payloads, "vLLM's structs write the same bytes"
    assert all(b.data_parallel_rank == 0 and isinstance(b.ts, float) for b in batches)
    events = [e for b in batches for e in b.events]
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
    assert kinds == {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU")}
    device_stored: dict[int, tuple[int | None, list[int]]] = {}  # hash -> parent, token ids
    host_stored = 0
    for e in events:
        assert e.group_idx == 0
        assert all(isinstance(x, int) and 0 <= x < 1 << 64 for x in e.block_hashes)
        if isinstance(e, BlockStored) and e.medium == "GPU":
            assert len(e.token_ids) == e.block_size * len(e.block_hashes) and e.block_size == 16
            assert e.parent_block_hash is None or e.parent_block_hash in device_stored
            parents = [e.parent_block_hash, *e.block_hashes[:-1]]
            for i, (h, parent) in enumerate(zip(e.block_hashes, parents, strict=True)):
                device_stored[h] = (parent, e.token_ids[16 * i : 16 * i + 16])
        elif isinstance(e, BlockStored):
            # written through: each host block carries the parent and tokens its device block had
            assert len(e.block_hashes) == 1 and e.block_size == 16
            assert device_stored[e.block_hashes[0]] == (e.parent_block_hash, e.token_ids)
            host_stored += 1
    assert host_stored


def test_published_hashes_are_the_low_64_bits_of_jaxkvs(engine_run):
    first = VLLM_DECODER.decode(engine_run["replayed"][0][1]).events[0]
    expected = [int.from_bytes(x[-8:], "big") for x in engine_run["first_hashes"]]
    assert first.parent_block_hash is None
    assert first.block_hashes[:2] == expected[:2]


# --- the replay socket ---------------------------------------------------------------
def test_a_replay_answers_from_the_requested_batch_with_what_is_still_buffered():
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, buffer_steps=3) as pub:
        for i in range(5):
            pub.publish(wire_events([stored(0, (h(i),))]))
        seqs = lambda frames: [int.from_bytes(s, "big") for s, _ in frames[:-1]]  # noqa: E731
        assert seqs(replay(pub.replay_endpoint, 1)) == [2, 3, 4], "1 is no longer buffered"
        assert seqs(replay(pub.replay_endpoint, 3)) == [3, 4]
        assert replay(pub.replay_endpoint, 9) == [(END, b"")]


@pytest.mark.parametrize("start", [2**63, 2**64 - 1, 2**63 + 12345])
def test_a_start_past_the_buffer_gets_the_end_marker_and_the_replay_thread_goes_on(start):
    """One 8-byte request of 2**63 or more ended the replay thread (islice raised), and
    every later replay went unanswered."""
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        pub.publish([])
        assert replay(pub.replay_endpoint, start) == [(END, b"")]
        assert [int.from_bytes(s, "big") for s, _ in replay(pub.replay_endpoint, 0)[:-1]] == [0]
        assert pub.num_failed_replays == 0


def test_a_client_that_never_reads_does_not_hold_the_replay_thread():
    """A client asking for replays it never reads held the thread 5 s a request; the
    sends now never wait: its answers are dropped and the next client is answered."""
    big = [WireBlockStored([1], None, list(range(50_000)), 16, None, "GPU", None)]  # ~150 KB a batch
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, buffer_steps=20) as pub:
        for _ in range(20):
            pub.publish(big)
        ctx = zmq.Context()
        mute = ctx.socket(zmq.DEALER)
        mute.setsockopt(zmq.RCVHWM, 1)
        mute.connect(pub.replay_endpoint)
        for _ in range(10):  # 30 MB asked for: more than the socket buffers and queues hold
            mute.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)
        start = time.monotonic()
        frames = replay(pub.replay_endpoint, 19)
        waited = time.monotonic() - start
        mute.close(linger=0)
        ctx.term()
        assert len(frames) == 2 and waited < 2.0, f"answered after {waited:.1f} s"
        assert pub.num_failed_replays >= 1, "the mute client's answers were dropped"


def test_malformed_replay_requests_are_counted_and_ignored():
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        pub.publish([])
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)
        sock.send_multipart([b"", b"7 bytes"])
        sock.send_multipart([(0).to_bytes(8, "big")])  # no delimiter frame
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while sock.poll(WAIT_MS):
            answers.append(sock.recv_multipart()[2])
            if answers[-1] == END:
                break
        sock.close(linger=0)
        ctx.term()
        assert answers == [(0).to_bytes(8, "big"), END], "only the well-formed request is answered"
        assert pub.num_bad_replay_requests == 2


# --- the conversion ------------------------------------------------------------------
def test_device_events_keep_their_group_hashes_chain_and_tokens():
    events = wire_events([stored(1, (h(1), h(2)), parent=h(0)), pool.BlockRemoved(1, (h(2),)), pool.AllBlocksCleared()])
    put, removed, cleared = events
    assert put == WireBlockStored([1, 2], 0, list(range(32)), 16, None, "GPU", None, group_idx=1), (
        "hashes are the low 64 bits, the parent too"
    )
    assert removed == WireBlockRemoved([2], "GPU", group_idx=1)
    assert cleared == WireAllBlocksCleared()


def test_host_events_become_cpu_events_one_per_group_run():
    host = [KeysStored(((h(1), 0), (h(2), 0), (h(3), 1))), KeysRemoved(((h(1), 0),))]
    events = wire_events([], host, block_sizes=(16, 32))
    assert events == [
        WireBlockStored([1, 2], None, [], 16, None, "CPU", None, group_idx=0),
        WireBlockStored([3], None, [], 32, None, "CPU", None, group_idx=1),
        WireBlockRemoved([1], "CPU", group_idx=0),
    ]


def test_a_host_chain_becomes_cpu_events_with_parents_and_tokens_and_no_group():
    chain = [stored(1, (h(1), h(2)), parent=h(0)), pool.BlockRemoved(1, (h(2),)), pool.AllBlocksCleared()]
    assert wire_events([], host_chain=chain) == [
        WireBlockStored([1, 2], 0, list(range(32)), 16, None, "CPU", None),
        WireBlockRemoved([2], "CPU"),
    ], "a reset goes out with the device's events, once"


class FakeHybrid:
    """A hybrid manager's (and host tier's) surface for publish_step: its plan and recorded events."""

    def __init__(self) -> None:
        self.config = plan_kv_cache(get_preset("qwen3-next-80b"), 8 << 30, max_model_len=4096)
        self.block_sizes = [g.block_size for g in self.config.groups]
        self.events: list = []

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events


def test_a_hybrids_host_tier_publishes_what_a_hit_can_use_with_it():
    manager, connector = FakeHybrid(), FakeHybrid()
    attn, state = 1, 0  # the plan's groups: full attention, Gated DeltaNet
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        manager.events = [stored(attn, (h(1), h(2))), stored(state, (h(1),))]
        assert pub.publish_step(manager, connector) == 0
        connector.events = [KeysStored(((h(2), state),))]  # the checkpoint at 2 reached host only
        assert pub.publish_step(manager, connector) == 1
        other = FakeHybrid()
        other.events = [stored(attn, (h(9),))]
        with pytest.raises(KVEventsError, match="one manager"):
            pub.publish_step(other, connector)
        assert other.events, "a refused step takes nothing"
        (_, first), (_, second), _ = replay(pub.replay_endpoint, 0)
    device = WireBlockStored([1], None, list(range(16)), 16, None, "GPU", None)
    with_host = WireBlockStored([1], None, list(range(16)), 16, None, "CPU", None)
    assert msgspec.msgpack.decode(first, type=WireEventBatch).events == [device, with_host]
    assert msgspec.msgpack.decode(second, type=WireEventBatch).events == [
        WireBlockStored([2], 1, list(range(16, 32)), 16, None, "CPU", None)
    ], "host keys name no parent: the chain comes from the device's stores"


def test_a_state_aware_publisher_refuses_a_host_tier_it_did_not_follow_from_the_start():
    manager, connector = FakeHybrid(), FakeHybrid()
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True) as pub:
        manager.events = [stored(1, (h(1),)), stored(0, (h(1),))]
        pub.publish_step(manager)
        manager.events = [pool.BlockRemoved(1, (h(1),))]
        with pytest.raises(KVEventsError, match="host tier"):
            pub.publish_step(manager, connector)
        assert manager.events, "a refused step takes nothing"
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, state_aware=False) as raw:
        assert raw.publish_step(manager, connector) == 0  # raw events follow no host tier


def test_hashes_may_be_published_as_bytes():
    (put,) = wire_events([stored(0, (h(7),))], int_hashes=False)
    assert put.block_hashes == [h(7)]


def test_external_hash_is_the_digest_read_big_endian_masked_to_64_bits():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert external_hash(digest, as_int=False) == digest


# --- settings ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"endpoint": "http://127.0.0.1:5557"}, "endpoint"),
        ({"replay_endpoint": "127.0.0.1:5558"}, "replay_endpoint"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
        ({"topic": b"kv"}, "topic"),
    ],
)
def test_bad_publisher_settings_are_refused_by_name(kwargs, word):
    with pytest.raises((KVEventsError, SocketSecurityError), match=word):
        KVEventPublisher(**{"endpoint": LOOPBACK, "plaintext_tcp": True, **kwargs})


def test_a_closed_publisher_refuses_to_publish():
    pub = KVEventPublisher(LOOPBACK, plaintext_tcp=True)
    pub.close()
    with pytest.raises(KVEventsError, match="closed"):
        pub.publish([])


@pytest.mark.subprocess
def test_jaxkv_imports_without_the_events_extra():
    code = (
        "import sys, jaxkv, jaxkv.core.manager, jaxkv.serving.engine\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'msgspec')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the whole buffer, numbering, idle batches, token ids, authentication -----------------
def test_a_replay_brings_back_all_of_a_large_buffer_to_a_client_that_reads_late():
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, buffer_steps=5000) as pub:
        for i in range(5000):  # ~2 KiB a batch: 10 MiB, more than the kernel's socket buffers hold
            pub.publish(wire_events([stored(0, tuple(h(64 * i + j) for j in range(64)))]))
        frames = replay(pub.replay_endpoint, 0, read_after_s=0.5)
    assert len(frames) == 5001, "every buffered batch and the end marker (the send queue dropped none)"


def test_a_restarted_publisher_numbers_from_0_again_so_its_restart_shows_as_a_fall():
    """vLLM numbers from 0 per publisher; jaxkv numbered from its start time in
    microseconds, which routers started late refused as a gap (issue 42)."""
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True) as first:
        assert [first.publish([]) for _ in range(3)] == [0, 1, 2]
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True) as second:
        assert second.next_seq == 0 and second.num_published == 0


def test_an_idle_publisher_publishes_empty_batches_so_a_late_subscriber_sees_where_the_stream_is():
    """vllm-router replays only on a gap it sees live: behind a replica idle since the
    router started it never learnt what the replica cached (issue 42)."""
    with pytest.raises(KVEventsError, match="idle_batch_s must be a positive number or None, got 0"):
        KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, idle_batch_s=0)
    with pytest.raises(KVEventsError, match="idle_batch_s needs a replay_endpoint"):
        KVEventPublisher(LOOPBACK, plaintext_tcp=True, idle_batch_s=0.1)
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, idle_batch_s=0.1) as pub:
        assert pub.publish(wire_events([stored(0, (h(1),))])) == 0
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)  # after the batch that holds the block
        try:
            assert sub.poll(5000), "an empty batch arrives while the publisher is idle"
            _, seq, payload = sub.recv_multipart()
        finally:
            sub.close(linger=0)
            ctx.term()
        assert int.from_bytes(seq, "big") >= 1 and msgspec.msgpack.decode(payload, type=WireEventBatch).events == []
        seqs = [int.from_bytes(s, "big") for s, _ in replay(pub.replay_endpoint, 0)[:-1]]
        assert seqs[0] == 0 and seqs == list(range(len(seqs))), "the stored block comes back through the replay"


def test_token_ids_can_be_left_out_of_stored_events():
    event = stored(0, (h(1),))
    [with_ids] = wire_events([event])
    [without] = wire_events([event], include_token_ids=False)
    assert with_ids.token_ids == list(range(16)) and without.token_ids == []
    assert without.block_hashes == with_ids.block_hashes


def test_tcp_needs_curve_keys_and_a_plaintext_client_hears_nothing():
    with pytest.raises(SocketSecurityError, match="tcp needs CURVE keys"):
        KVEventPublisher(LOOPBACK)
    with pytest.raises(SocketSecurityError, match="loopback only"):
        KVEventPublisher("tcp://0.0.0.0:*", plaintext_tcp=True)
    keys = CurveKeys.generate()
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, curve=keys) as pub:
        pub.publish([])
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert not sock.poll(500), "an unauthenticated client got an answer"
        sock.close(linger=0)
        ctx.term()


@pytest.mark.subprocess
@pytest.mark.parametrize("hidden", ["msgspec", "zmq"])
def test_without_the_events_extra_importing_names_it(hidden):
    code = (
        "from jaxkv.errors import ExtraNotInstalledError\n"
        "try:\n    import jaxkv.serving.kv_events\n"
        "except ExtraNotInstalledError as err:\n"
        "    print(isinstance(err, ImportError), err.name)\n    print(err)\n"
    )
    result = run_python_without((hidden,), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"True {hidden}",
        f"KV events need pyzmq and msgspec: pip install 'jaxkv[events]' (no module named {hidden!r})",
    ]


def test_abstract_ipc_needs_curve_keys_as_tcp_does():
    """``ipc://@name`` has no file to guard it: any local user connected to a publisher,
    replay socket or replica bound there without keys."""
    name = f"ipc://@jaxkv-test-{time.time_ns()}"
    with pytest.raises(SocketSecurityError, match="abstract-namespace ipc has no file permissions"):
        KVEventPublisher(name)
    with pytest.raises(SocketSecurityError, match="abstract-namespace ipc"):
        KVEventPublisher(f"{name}-events", replay_endpoint=f"{name}-replay", plaintext_tcp=True)
    with KVEventPublisher(name, curve=CurveKeys.generate()) as pub:
        assert pub.endpoint == name
