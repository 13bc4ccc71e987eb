"""The router's prefix index: events applied in order, copies counted, gaps filled from
the replay socket or reported; a subscriber that leaves mid-run and comes back ends
with the index of one that never left (and of the engine's own prefix cache)."""

import time

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from vllm_event_schema import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from jaxkv.device.metadata import Buckets  # noqa: E402
from jaxkv.fleet.prefix_index import (  # noqa: E402
    EventGapError,
    KVEventSubscriber,
    PrefixIndex,
    ReplayTimeoutError,
)
from jaxkv.serving.engine import Engine, StepProgress  # noqa: E402
from jaxkv.serving.kv_events import (  # noqa: E402
    KVEventPublisher,
    KVEventsError,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEventBatch,
    external_hash,
)
from jaxkv.serving.offload_connector import OffloadConfig  # noqa: E402
from jaxkv.serving.zmq_security import CurveKeys, SocketSecurityError  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
KEYS = CurveKeys.generate()
"""The test deployment's CURVE keys (tcp needs them)."""
MAX_TRIES = 50


def put(*hashes: int, medium: str = "GPU", group: int = 0) -> WireBlockStored:
    return WireBlockStored(list(hashes), None, [], 16, None, medium, None, group_idx=group)


def drop(*hashes: int, medium: str = "GPU", group: int = 0) -> WireBlockRemoved:
    return WireBlockRemoved(list(hashes), medium, group_idx=group)


# --- the index -----------------------------------------------------------------------
def test_a_hash_stays_until_its_last_copy_is_removed():
    index = PrefixIndex()
    index.apply("r0", [put(1, 2), put(1)])
    index.apply("r0", [drop(1)])
    assert index.locations(1) == {("r0", "GPU")}
    index.apply("r0", [drop(1)])
    assert index.locations(1) == frozenset() and index.locations(2) == {("r0", "GPU")}


def test_groups_and_media_hold_copies_apart():
    index = PrefixIndex()
    index.apply("r0", [put(1, group=0), put(1, group=1), put(1, medium="CPU")])
    index.apply("r0", [drop(1, group=1)])
    assert index.locations(1) == {("r0", "GPU"), ("r0", "CPU")}
    index.apply("r0", [drop(1, group=0)])
    assert index.locations(1) == {("r0", "CPU")}


def test_all_blocks_cleared_drops_the_device_entries_only():
    index = PrefixIndex()
    index.apply("r0", [put(1, 2), put(2, medium="CPU")])
    index.apply("r1", [put(1)])
    index.apply("r0", [WireAllBlocksCleared()])
    assert index.snapshot() == {1: {("r1", "GPU")}, 2: {("r0", "CPU")}}


def test_removing_what_the_index_does_not_hold_changes_nothing():
    index = PrefixIndex()
    index.apply("r0", [put(1)])
    index.apply("r0", [drop(7), drop(1, medium="CPU"), drop(1, group=3)])
    assert index.snapshot() == {1: {("r0", "GPU")}}


def test_an_event_without_medium_is_a_device_event():
    index = PrefixIndex()
    index.apply("r0", [WireBlockStored([5], None, [], 16, None, None, None)])
    assert index.locations(5) == {("r0", "GPU")}


def test_longest_prefix_per_replica_runs_across_media():
    index = PrefixIndex()
    index.apply("r0", [put(1, 2), put(3, medium="CPU")])
    index.apply("r1", [put(1), put(3)])
    assert index.longest_prefix([1, 2, 3, 4]) == {"r0": 3, "r1": 1}
    assert index.longest_prefix([1, 2, 3, 4], medium="GPU") == {"r0": 2, "r1": 1}
    index.drop_replica("r1")
    assert index.longest_prefix([1]) == {"r0": 1}


def test_a_batch_from_a_vllm_server_is_applied():
    """Written with vLLM's structs: no group (a pre-hybrid server), bytes hashes, a 2-copy removal."""
    batch = KVEventBatch(
        ts=1.0,
        events=[
            BlockStored([b"a" * 32, b"b" * 32], None, list(range(32)), 16, None, "GPU", None),
            BlockStored([b"a" * 32], None, list(range(16)), 16, None, "GPU", None),
            BlockRemoved([b"a" * 32], "GPU"),
        ],
        data_parallel_rank=1,
    )
    index = PrefixIndex()
    index.apply("dp1", msgspec.msgpack.Decoder(WireEventBatch).decode(msgspec.msgpack.encode(batch)).events)
    assert index.longest_prefix([b"a" * 32, b"b" * 32]) == {"dp1": 2}, "one copy of a is left"


# --- subscribers on a synthetic stream --------------------------------------------------
@pytest.fixture
def publisher():
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=MAX_TRIES + 10, curve=KEYS) as pub:
        yield pub


def subscriber(index: PrefixIndex, pub: KVEventPublisher, *, replay: bool = True, **kw) -> KVEventSubscriber:
    return KVEventSubscriber(
        index,
        "r0",
        pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
        replay_timeout_s=10,
        curve=KEYS,
        **kw,
    )


def publish_until_heard(pub: KVEventPublisher, sub: KVEventSubscriber, first: int) -> int:
    """Publish one new hash per batch until the subscriber hears one live (a SUB socket
    misses what goes out before its subscription lands); the next unused hash."""
    for i in range(first, first + MAX_TRIES):
        pub.publish([put(i)])
        if sub.poll(0.2):
            return i + 1
    raise AssertionError("the subscriber heard nothing live")


def test_a_live_gap_is_filled_from_the_replay_socket(publisher):
    index = PrefixIndex()
    with subscriber(index, publisher) as sub:
        publisher.publish([put(0)])
        sub.catch_up()
        sub.disconnect()
        publisher.publish([put(1)])
        sub.connect()
        last = publish_until_heard(publisher, sub, 2)
        assert sub.next_seq == publisher.next_seq
        assert set(index.snapshot()) == set(range(last)), "batch 1 came back through the replay"


def test_a_gap_longer_than_the_replay_buffer_is_reported_and_the_replica_dropped():
    index = PrefixIndex()
    publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=2, curve=KEYS)
    with publisher, subscriber(index, publisher) as sub:
        e = 0  # vLLM's numbering: from 0 per publisher
        publisher.publish([put(0)])
        assert sub.catch_up() == 1 and index.locations(0)
        sub.disconnect()
        for i in range(1, 5):
            publisher.publish([put(i)])
        sub.connect()
        with pytest.raises(EventGapError, match=f"batches {e + 1}..{e + 2} are lost") as err:
            sub.catch_up()
        assert (err.value.missing_from, err.value.resumed_at) == (e + 1, e + 3)
        assert set(index.snapshot()) == {3, 4}, "what came before the gap is dropped, what follows is applied"
        assert sub.next_seq == e + 5


def test_without_a_replay_socket_a_gap_is_reported(publisher):
    index = PrefixIndex()
    with subscriber(index, publisher, replay=False) as sub:
        last = publish_until_heard(publisher, sub, 0)
        sub.disconnect()
        publisher.publish([put(last)])  # while away: it can never get it
        sub.connect()
        with pytest.raises(EventGapError, match="no replay socket") as err:
            publish_until_heard(publisher, sub, last + 1)
        assert err.value.missing_from == last
        assert len(index) == 1 and min(index.snapshot()) > last, "the entries are dropped, the live batch applied"


@pytest.fixture
def mute_replay():
    """A replay endpoint that takes requests and never answers, and a publisher whose
    stream a subscriber (``follow(timeout_s)``) reads with that replay endpoint."""
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex()
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True) as pub:

        def follow(timeout_s: float) -> KVEventSubscriber:
            endpoint = f"tcp://127.0.0.1:{port}"
            return KVEventSubscriber(
                index, "r0", pub.endpoint, replay_endpoint=endpoint, replay_timeout_s=timeout_s, plaintext_tcp=True
            )

        yield pub, index, follow
    mute.close(linger=0)
    ctx.term()


def test_a_silent_replay_socket_times_out_and_changes_nothing(mute_replay):
    _, index, follow = mute_replay
    with follow(0.2) as sub:
        with pytest.raises(ReplayTimeoutError, match="no replay answer"):
            sub.catch_up()
        assert sub.next_seq is None and len(index) == 0


def test_a_mute_replay_socket_never_stalls_poll_and_the_subscriber_follows_the_live_batches(mute_replay):
    """Each live batch used to wait ``replay_timeout_s`` on the mute socket in poll (a
    router's one thread: no heartbeat read meanwhile); the replay now runs beside the
    stream, is abandoned once, and the live batches are followed."""
    pub, index, follow = mute_replay
    longest, timeouts = 0.0, 0
    with follow(0.5) as sub:
        end = time.monotonic() + 2.5
        i = 0
        while time.monotonic() < end:
            pub.publish([put(i)])
            i += 1
            start = time.monotonic()
            try:
                sub.poll()
            except ReplayTimeoutError:
                timeouts += 1
            longest = max(longest, time.monotonic() - start)
            time.sleep(0.02)
        sub.poll(0.5)
    assert longest < 0.2, f"a poll waited {longest:.2f} s"
    assert timeouts == 1, "one timeout, then the live stream without replays"
    assert sub.next_seq == pub.next_seq and max(index.snapshot()) == i - 1


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"endpoint": "localhost:5557"}, "endpoint"),
        ({"replay_timeout_s": 0}, "replay_timeout_s"),
        ({"topic": 1}, "topic"),
    ],
)
def test_bad_subscriber_settings_are_refused_by_name(kwargs, word):
    with pytest.raises((KVEventsError, SocketSecurityError), match=word):
        KVEventSubscriber(PrefixIndex(), "r0", **{"endpoint": "tcp://127.0.0.1:5557", "curve": KEYS, **kwargs})


# --- an engine run ------------------------------------------------------------------
def test_a_subscriber_that_leaves_mid_run_rebuilds_the_index_of_one_that_stayed():
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 512, 40).tolist()
    rounds = [[shared + rng.integers(0, 512, n).tolist() for n in (10, 30, 50, 70)]]
    rounds += [[rng.integers(0, 512, 60).tolist() for _ in range(4)] for _ in range(2)]
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, curve=KEYS) as pub:
        eng = Engine.build(
            "tiny-llama",
            memory_bytes=2 << 20,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            buckets=Buckets((64,), (4,), (16,)),
            offload=OffloadConfig(1 << 20, store="write_through"),
            kv_events=pub,
        )
        stayed, back = PrefixIndex(), PrefixIndex()
        with subscriber(stayed, pub) as steady, subscriber(back, pub) as leaver:
            marks = {}

            def router(call: int):
                def on_step(progress: StepProgress) -> None:
                    steady.poll()
                    if leaver.connected:
                        leaver.poll()
                    if progress.step == 3 and call == 0:
                        leaver.disconnect()
                        marks["left"] = pub.num_published
                    if progress.step == 3 and call == 1:
                        leaver.connect()
                        marks["back"] = pub.num_published

                return on_step

            for call, prompts in enumerate(rounds):
                eng.generate(prompts, 8, progress=router(call))
            for sub in (steady, leaver):
                sub.catch_up()
                sub.poll()
            assert marks["back"] > marks["left"], "batches went out while it was away"
            assert steady.next_seq == leaver.next_seq == pub.next_seq
        assert back.snapshot() == stayed.snapshot()
        device = {h for h, where in stayed.snapshot().items() if ("r0", "GPU") in where}
        assert device == {external_hash(h) for h in eng.manager.pool.cached[0]}, "the device prefix cache, exactly"
        assert any(("r0", "CPU") in where for where in stayed.snapshot().values())


# --- a publisher restarted on the same endpoint -----------------------------------------
def test_a_restarted_publisher_resyncs_the_index_instead_of_keeping_the_dead_caches_entries(tmp_path):
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    index = PrefixIndex()
    first = KVEventPublisher(events, replay_endpoint=replay)
    with KVEventSubscriber(index, "r0", events, replay_endpoint=replay, replay_timeout_s=10) as sub:
        with first:
            last = publish_until_heard(first, sub, 0)
            for i in range(last, last + 10):  # live numbers well above where the next publisher starts
                first.publish([put(i)])
            last += 10
            while sub.next_seq != first.next_seq:
                assert sub.poll(1.0), "the live batches of a connected subscriber arrive"
        assert set(index.snapshot()) == set(range(last))
        with KVEventPublisher(events, replay_endpoint=replay) as second:
            publish_until_heard(second, sub, 100)
            sub.catch_up()
            assert set(index.snapshot()) == set(range(100, 100 + second.num_published)), "the dead cache is gone"
            assert sub.num_resyncs == 1, "the fall to 0 is read as a restart"


def test_undecodable_batches_are_counted_and_skipped(tmp_path):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/ev")
    index = PrefixIndex()
    with KVEventSubscriber(index, "r0", f"ipc://{tmp_path}/ev") as sub:
        good = msgspec.msgpack.encode(WireEventBatch(0.0, [put(1)]))
        for _ in range(MAX_TRIES):
            pub.send_multipart([b"", (7).to_bytes(8, "big"), b"\xc1 garbage"])
            pub.send_multipart([b"one frame"])
            pub.send_multipart([b"", (8).to_bytes(8, "big"), good])
            if sub.poll(0.2):
                break
        assert sub.num_bad_batches >= 2 and 1 in index.snapshot()
    pub.close(linger=0)
    ctx.term()
