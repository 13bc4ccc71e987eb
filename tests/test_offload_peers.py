"""Host tiers that replicas on one machine share by reading each other's files: a block a
peer recorded is found and copied with its parent and token ids; a copy the peer may have
overwritten while it was read is dropped (the race driven deterministically); a peer's
compaction, a torn or bad journal, another fingerprint and a deleted file are misses, never
exceptions; and an engine serves a prompt another engine computed, with the cold tokens."""

import logging

import numpy as np
import pytest

from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, dense_greedy_generate, get_model_config
from jaxkv.offload.peers import PeerTiers
from jaxkv.offload.persistent import PersistentHostTier, header
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.offload_connector import ConnectorError, OffloadConfig

FP = {"model": "m", "hash_algo": "sha256"}
ROW = (2, 3)
NUM_BLOCKS = 4


def key(i: int) -> tuple[bytes, int]:
    return (bytes([i]) * 32, 0)


def tier(path, fingerprint=FP) -> PersistentHostTier:
    return PersistentHostTier(path, fingerprint, NUM_BLOCKS, ROW, np.float32)


def put(t: PersistentHostTier, i: int, block: int, value: float) -> None:
    """Store key ``i`` in ``block`` as the owner does: the bytes, then the record."""
    t.rows(t.shape, np.float32)[block] = value
    t.stored([key(i)], [block], [(None, (i, i + 1))])


def reader(own: PersistentHostTier, pattern) -> PeerTiers:
    return PeerTiers(str(pattern), own.path, own.fingerprint, own.shape, own.dtype, rescan_s=0.0)


@pytest.fixture
def pair(tmp_path):
    a, b = tier(tmp_path / "a.kv"), tier(tmp_path / "b.kv")
    yield a, b
    a.close()
    b.close()


def test_a_peers_recorded_block_is_read_with_its_tokens_and_its_own_file_is_not_a_peer(pair, tmp_path):
    a, b = pair
    put(b, 7, 1, 1.0)  # b's own block: never read as a peer's
    peers = reader(b, tmp_path / "*")
    peers.refresh()
    assert peers.paths == (str(a.path.resolve()),)
    assert not peers.holds(key(7))
    a.rows(a.shape, np.float32)[2] = 5.0  # bytes written, not recorded yet: not findable
    peers.refresh()
    assert not peers.holds(key(1))
    a.stored([key(1)], [2], [(None, (1, 2))])
    peers.refresh()
    assert peers.holds(key(1))
    [(row, info), missing] = peers.read([key(1), key(9)])
    assert (row == 5.0).all() and row.shape == ROW and info == (None, (1, 2))
    assert missing is None


def test_a_peer_that_starts_later_is_found_and_one_that_vanishes_is_a_miss(pair, tmp_path):
    _, b = pair
    peers = reader(b, tmp_path / "*.kv")
    peers.refresh()
    c = tier(tmp_path / "c.kv")
    put(c, 3, 1, 3.0)
    peers.refresh()
    assert peers.holds(key(3))
    c.close()
    (tmp_path / "c.kv.journal").unlink()
    (tmp_path / "c.kv").unlink()
    assert peers.read([key(3)]) == [None]  # its journal is gone: the copy is not trusted
    peers.refresh()
    assert not peers.holds(key(3)) and str(c.path.resolve()) not in peers.paths


@pytest.fixture
def racing(pair, tmp_path):
    """``a`` holding keys 1 and 2, ``b``'s reader of it, and ``race(action)``: run the owner's
    ``action`` between a read's copy and its check (the race, made deterministic)."""
    a, b = pair
    put(a, 1, 1, 1.0)
    put(a, 2, 2, 2.0)
    peers = reader(b, tmp_path / "*.kv")
    peers.refresh()
    poll = peers._poll

    def race(action):
        def in_between(peer):
            action()
            return poll(peer)

        peers._poll = in_between if action is not None else poll

    return a, peers, race


def test_a_block_the_peer_reuses_while_it_is_copied_is_dropped(racing):
    a, peers, race = racing

    def evict():
        a.removed([key(1)])  # the owner's order: removed, then the new bytes, then stored
        put(a, 5, 1, 9.0)

    race(evict)
    torn, kept = peers.read([key(1), key(2)])
    assert torn is None  # a copy that may hold 9.0 is never returned
    assert kept is not None and (kept[0] == 2.0).all()
    race(None)
    [(row, _)] = peers.read([key(5)])
    assert (row == 9.0).all()


def test_a_peers_compaction_is_read_again_from_its_start(racing):
    a, peers, race = racing

    def compact():
        a.removed([key(1)])
        a.compact({key(2): 2}, {key(2): (None, (2, 3))})  # a new journal (os.replace: a new inode)

    race(compact)
    assert peers.read([key(2)]) == [None]  # across a new inode a copy is not trusted
    race(None)
    peers.refresh()
    assert not peers.holds(key(1))
    [(row, info)] = peers.read([key(2)])
    assert (row == 2.0).all() and info == (None, (2, 3))


def test_a_torn_tail_is_read_once_whole_and_a_bad_record_holds_nothing(pair, tmp_path):
    a, b = pair
    put(a, 1, 1, 1.0)
    a.close()
    journal = tmp_path / "a.kv.journal"
    put(b, 2, 2, 2.0)  # a record of the same format, appended to a's journal by hand below
    record = b.journal_path.read_bytes()[len(header(b.fingerprint)) :]
    peers = reader(tier(tmp_path / "c.kv"), tmp_path / "a.kv")
    with open(journal, "ab") as f:
        f.write(record[:5])  # a record being written
    peers.refresh()
    assert not peers.holds(key(1))  # what comes after is unknown: nothing is held meanwhile
    with open(journal, "ab") as f:
        f.write(record[5:])
    peers.refresh()
    assert peers.holds(key(1)) and peers.holds(key(2))  # whole now: applied
    bad = bytearray(record)
    bad[-1] ^= 0xFF
    with open(journal, "ab") as f:
        f.write(bytes(bad))  # a record whose checksum fails: the owner's later records are unknown
    peers.refresh()
    peers.refresh()
    assert not peers.holds(key(1))
    assert peers.read([key(1)]) == [None]


def test_a_peer_of_another_fingerprint_is_ignored_with_one_warning(tmp_path, caplog):
    own, other = tier(tmp_path / "a.kv"), tier(tmp_path / "b.kv", {**FP, "model": "other"})
    put(other, 1, 1, 1.0)
    peers = reader(own, tmp_path / "*.kv")
    with caplog.at_level(logging.WARNING, logger="jaxkv.offload.peers"):
        peers.refresh()
        peers.refresh()
    assert not peers.holds(key(1)) and peers.paths == ()
    assert caplog.text.count("is ignored") == 1 and "model" in caplog.text
    own.close()
    other.close()


def test_peers_need_a_file_of_the_tiers_own():
    with pytest.raises(ConnectorError, match="peers"):
        OffloadConfig(1 << 20, peers="/tmp/*.kv")


# ------------------------------------------------------------------ engine
ONE_SHAPE = Buckets((64,), (4,), (16,))


@pytest.fixture(scope="module")
def llama() -> TinyLM:
    return TinyLM(get_model_config("tiny-llama"), seed=0)


def engine(model: TinyLM, path, peers=None) -> Engine:
    plan = plan_kv_cache(
        model.config.layer_specs(), 2 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    config = OffloadConfig(4 << 20, store="write_through", path=str(path), model_id="tiny-llama@0", peers=peers)
    return Engine(model, plan, max_num_seqs=4, buckets=ONE_SHAPE, offload=config)


@pytest.mark.slow  # two engines' first steps compile
def test_an_engine_serves_a_prompt_its_peer_computed_with_the_cold_tokens(llama, tmp_path):
    prompt = np.random.default_rng(5).integers(0, 512, 100).tolist()
    cold = tuple(dense_greedy_generate(llama, [prompt], 4)[0])
    a = engine(llama, tmp_path / "a.kv", peers=str(tmp_path / "*.kv"))  # the fleet: every replica reads the others
    b = engine(llama, tmp_path / "b.kv", peers=str(tmp_path / "*.kv"))
    try:
        assert a.generate([prompt], 4).outputs[0].output_token_ids == cold
        a.connector.finish_stores()
        out = b.generate([prompt], 4).outputs[0]
        assert out.output_token_ids == cold
        assert out.num_cached_tokens == 96  # every full block but the last token's, copied from a's file
        assert b.connector.stats.num_peer_blocks == 6 and b.connector.stats.num_peer_dropped == 0
        assert b.connector.peers.paths == (str((tmp_path / "a.kv").resolve()),)
        assert b.connector.num_held_host_blocks == 0  # loaded through staging rows: a's file keeps them
        assert b.connector.num_host_blocks == a.connector.num_host_blocks == 64  # staging rows come on top
        assert b.connector.host_bytes == (64 + 16) * (4 << 20) // 64  # 16 staging rows beyond the 4 MiB
        assert b.audit().host_blocks_leaked == 0
    finally:
        b.connector.close()
        a.connector.close()
    tiers = [e.connector.persistent for e in (a, b)]
    reloaded = [PersistentHostTier(t.path, t.fingerprint, t.num_blocks, t.shape[1:], t.dtype) for t in tiers]
    kept = [t.entries for t in reloaded]
    for t in reloaded:
        t.close()
    assert len(kept[0]) >= 6 and set(kept[0]).isdisjoint(kept[1])  # one copy in the fleet's files: a's
