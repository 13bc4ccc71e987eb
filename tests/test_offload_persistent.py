"""The host tier kept in a file: the journal's rules (a key findable only once recorded after its
bytes, a torn tail dropped, another writer's file never read, one holder at a time) and an
engine that reloads it: a prompt served before the restart hits the host tier after it, with
the tokens of a cold run, and the reloaded blocks are announced as host-tier events."""

import logging
import os

import msgspec
import numpy as np
import pytest
import zmq

from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, dense_greedy_generate, get_model_config
from jaxkv.offload import persistent
from jaxkv.offload.persistent import PersistentHostTier, PersistentTierError
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.kv_events import END_SEQ, KVEventPublisher, external_hash
from jaxkv.serving.offload_connector import ConnectorError, OffloadConfig

FP = {"model": "m", "hash_algo": "sha256"}
ROW = (2, 3)


def key(i: int) -> tuple[bytes, int]:
    return (bytes([i]) * 32, 0)


def tier(path, fingerprint=FP, num_blocks=4) -> PersistentHostTier:
    return PersistentHostTier(path, fingerprint, num_blocks, ROW, np.float32)


def test_recorded_keys_and_bytes_come_back_and_removed_ones_do_not(tmp_path):
    t = tier(tmp_path / "host")
    rows = t.rows((5, *ROW), np.float32)
    rows[1], rows[2] = 1.0, 2.0
    t.stored([key(1), key(2)], [1, 2], [(None, (1, 2)), (key(1)[0], (3, 4))])
    t.removed([key(1)])
    rows[1] = 3.0
    t.stored([key(3)], [1], [None])
    t.close()  # the mapping is not flushed on purpose: a killed process leaves its page cache
    again = tier(tmp_path / "host")
    assert again.entries == {key(2): 2, key(3): 1}
    assert again.infos == {key(2): (key(1)[0], (3, 4))}  # what its event carries: parent, token ids
    assert again.num_dropped_bytes == 0
    rows = again.rows((5, *ROW), np.float32)
    assert (rows[2] == 2.0).all() and (rows[1] == 3.0).all()
    again.close()


def test_a_torn_tail_is_dropped_and_the_journal_compacted(tmp_path, caplog):
    t = tier(tmp_path / "host")
    t.stored([key(1)], [1], [None])
    t.stored([key(2)], [2], [None])
    t.close()
    journal = tmp_path / "host.journal"
    data = journal.read_bytes()
    journal.write_bytes(data[:-3])  # the last record torn
    with caplog.at_level(logging.WARNING, logger="jaxkv.offload.persistent"):
        again = tier(tmp_path / "host")
    assert again.entries == {key(1): 1}
    assert again.num_dropped_bytes > 0
    assert "torn tail" in caplog.text
    again.close()
    assert len(journal.read_bytes()) < len(data) - 3  # rewritten with the live keys only
    corrupt = bytearray(journal.read_bytes())
    corrupt[-1] ^= 0xFF  # a bad checksum counts as torn too
    journal.write_bytes(bytes(corrupt))
    third = tier(tmp_path / "host")
    assert third.entries == {}
    third.close()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fingerprint": {**FP, "model": "other"}}, "model"),
        ({"fingerprint": {**FP, "hash_algo": "xxh3_128"}}, "hash_algo"),
        ({"num_blocks": 8}, "num_blocks"),
    ],
)
def test_a_file_written_by_something_else_is_never_read(tmp_path, caplog, change, named):
    t = tier(tmp_path / "host")
    t.rows((5, *ROW), np.float32)[1] = 7.0
    t.stored([key(1)], [1], [None])
    t.close()
    with caplog.at_level(logging.WARNING, logger="jaxkv.offload.persistent"):
        other = tier(tmp_path / "host", **change)
    assert other.entries == {}
    assert "starts cold" in caplog.text and named in caplog.text
    assert not other.rows(other.shape, np.float32).any()  # the old bytes are gone too
    other.close()


def test_a_long_journal_is_compacted_to_the_live_keys(tmp_path):
    t = tier(tmp_path / "host")
    for i in range(50):
        t.stored([key(i)], [1 + i % 4], [(None, (i,))])
        t.removed([key(i)])
    t.stored([key(99)], [2], [(None, (99,))])
    assert t.wants_compaction
    t.compact({key(99): 2}, {key(99): (None, (99,))})
    assert not t.wants_compaction
    t.stored([key(98)], [3], [None])
    t.close()
    again = tier(tmp_path / "host")
    assert again.entries == {key(99): 2, key(98): 3} and again.infos == {key(99): (None, (99,))}
    again.close()


def test_one_process_holds_the_files(tmp_path):
    t = tier(tmp_path / "host")
    with pytest.raises(PersistentTierError, match="held by another process"):
        tier(tmp_path / "host")
    t.close()
    tier(tmp_path / "host").close()


# ------------------------------------------------------------------ engine
ONE_SHAPE = Buckets((64,), (4,), (16,))
LOOPBACK = "tcp://127.0.0.1:*"


@pytest.fixture(scope="module")
def llama() -> TinyLM:
    return TinyLM(get_model_config("tiny-llama"), seed=0)


def engine(model: TinyLM, path, model_id: str = "tiny-llama@0", kv_events=None) -> Engine:
    plan = plan_kv_cache(
        model.config.layer_specs(), 2 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    config = OffloadConfig(1 << 20, store="write_through", path=str(path), model_id=model_id)
    return Engine(model, plan, max_num_seqs=4, buckets=ONE_SHAPE, offload=config, kv_events=kv_events)


def replayed_cpu_blocks(endpoint: str) -> list[tuple[int, int | None, list[int]]]:
    """The host-tier ("CPU") blocks (hash, parent, token ids) stored in the batches a replay from 0 answers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        hashes = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return hashes
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored" and event["medium"] == "CPU":
                    assert len(event["block_hashes"]) == 1
                    hashes.append((event["block_hashes"][0], event.get("parent_block_hash"), event["token_ids"]))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.slow  # two engines' first steps compile
def test_an_engine_restarted_on_the_file_hits_its_host_tier_with_the_cold_tokens(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(persistent, "RECORDS_PER_BLOCK", 0)  # compacted at every settled store: it keeps the keys
    prompt = np.random.default_rng(3).integers(0, 512, 100).tolist()
    cold = tuple(dense_greedy_generate(llama, [prompt], 4)[0])
    first = engine(llama, tmp_path / "host")
    assert first.generate([prompt], 4).outputs[0].output_token_ids == cold
    first.connector.close()
    del first
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, plaintext_tcp=True) as publisher:
        again = engine(llama, tmp_path / "host", kv_events=publisher)
        reloaded = again.connector.persistent.entries
        assert len(reloaded) >= 6
        # announced before any request: a router that kept running credits them again
        announced = replayed_cpu_blocks(publisher.replay_endpoint)
        chain = [external_hash(h) for h, _ in reloaded]
        # the prompt's blocks, parents first, each with its tokens: what a router indexes
        assert announced == [
            (h, chain[i - 1] if i else None, prompt[16 * i : 16 * i + 16]) for i, h in enumerate(chain)
        ]
        out = again.generate([prompt], 4).outputs[0]
    assert out.output_token_ids == cold
    assert out.num_cached_tokens == 96  # every full block but the last token's, from the file
    assert again.connector.stats.num_loaded_tokens == 96
    assert again.audit().host_blocks_leaked == 0
    again.connector.close()
    other = engine(llama, tmp_path / "host", model_id="another")
    assert other.generate([prompt], 4).outputs[0].num_cached_tokens == 0
    other.connector.close()


@pytest.mark.slow  # builds a tiny Qwen3-Next engine
def test_a_hybrid_is_refused_a_host_tier_in_a_file(tmp_path):
    model = TinyLM(get_model_config("tiny-qwen3-next"), seed=0)
    plan = plan_kv_cache(
        model.config.layer_specs(), 3 << 19, max_model_len=320, options=PlanOptions(max_num_batched_tokens=64)
    )
    with pytest.raises(ConnectorError, match="recurrent state: a host tier in a file holds KV only"):
        Engine(model, plan, max_num_seqs=2, offload=OffloadConfig(8 << 20, path=str(tmp_path / "h")))
    assert not os.path.exists(tmp_path / "h.journal")
