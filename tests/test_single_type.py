"""Per-type cache-hit rules and span rules of the single-type managers."""

import pytest
from kv_configs import FULL, admit, make_manager, window

from jaxkv.core.manager import Request
from jaxkv.core.single_type import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    manager_class_for,
)
from jaxkv.specs import ChunkedLocalAttentionSpec, MambaSpec, MLASpec


def cached_pattern(pattern: str) -> tuple[list[dict], list[bytes]]:
    """One group's hash map with block i cached where pattern[i] == 'T'."""
    hashes = [bytes([i]) for i in range(len(pattern))]
    m = {hashes[i]: 100 + i for i, c in enumerate(pattern.split()) if c == "T"}
    return [m], hashes


def search(cls, spec, pattern: str, block_size: int, max_blocks: int | None = None):
    """(num_blocks, first_real) of a hit; checks the ids returned are the cached ones."""
    maps, hashes = cached_pattern(pattern)
    hashes = hashes[: len(pattern.split())]
    hit = cls.find_longest_cache_hit(maps, hashes, max_blocks or len(hashes), spec, block_size)
    assert hit.block_ids == [[100 + i for i in range(hit.first_real, hit.num_blocks)]]
    return hit.num_blocks, hit.first_real


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("T T F T F F T T F T T T", (12, 10)),  # the window's last two blocks are cached
        ("T T F T F F T T F F F", (8, 6)),
        ("T F F", (1, 0)),  # a run from block 0 shorter than the window
        ("F T F", (0, 0)),
    ],
)
def test_sliding_window_takes_the_rightmost_run_covering_the_window(pattern, expected):
    assert search(SlidingWindowManager, window(4), pattern, block_size=2) == expected


def test_sliding_window_hit_through_the_manager_has_leading_nulls(tokens):
    mgr = make_manager(40, window(4), block_size=2)
    req = Request("a", tokens(0, 25))
    admit(mgr, req)
    blocks = mgr.get_block_ids("a")[0]
    mgr.free("a")
    pattern = ["T", "T", "F", "T", "F", "F", "T", "T", "F", "T", "T", "T"]
    mgr.evict_blocks([b for b, c in zip(blocks, pattern, strict=False) if c == "F"])
    hit, n = mgr.get_computed_blocks(Request("b", tokens(0, 25)))
    assert n == 24
    assert hit.get_block_ids()[0] == [0] * 10 + blocks[10:12]


def test_full_attention_hit_stops_at_the_first_miss():
    assert search(FullAttentionManager, FULL, "T T F T", 16) == (2, 0)
    assert search(FullAttentionManager, FULL, "T T T T", 16, max_blocks=3) == (3, 0)


def test_full_attention_needs_every_group_of_the_type():
    hashes = [b"a", b"b", b"c"]
    maps = [{b"a": 1, b"b": 2, b"c": 3}, {b"a": 4, b"b": 5}]
    assert FullAttentionManager.find_longest_cache_hit(maps, hashes, 3, FULL, 16) == (2, 0, [[1, 2], [4, 5]])


def test_chunked_local_needs_only_the_current_chunk():
    spec = ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=1, attention_chunk_size=4)
    # block size 2: a chunk is 2 blocks. max 5 blocks = 10 tokens -> chunk starts at token 8 (block 4).
    assert search(ChunkedLocalAttentionManager, spec, "F F F F T", 2) == (5, 4)
    assert search(ChunkedLocalAttentionManager, spec, "F F F F F", 2) == (4, 4)
    # 8 tokens end a chunk: the next token starts a new chunk and needs nothing cached.
    assert search(ChunkedLocalAttentionManager, spec, "T T T F", 2) == (4, 4)
    wide = ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=1, attention_chunk_size=8)
    assert search(ChunkedLocalAttentionManager, wide, "F F F F T T F", 2) == (6, 4)


def mamba_spec() -> MambaSpec:
    return MambaSpec(shapes=((4, 3), (4, 8)), dtypes=("float32", "float32"))


def test_mamba_hit_is_the_last_cached_state():
    assert search(MambaManager, mamba_spec(), "T F T F", 16) == (3, 2)
    assert search(MambaManager, mamba_spec(), "F F F", 16) == (0, 0)


def test_mamba_keeps_one_live_state_and_caches_boundary_states(tokens):
    mgr = make_manager(20, mamba_spec(), block_size=4)
    req = Request("m", tokens(0, 10))
    _, _, _new = admit(mgr, req)
    # Only the block that will hold the state after 10 tokens is allocated.
    assert mgr.get_block_ids("m") == ([0, 0, 1],)
    assert mgr.pool.num_cached_blocks() == 0  # 10 is not a block boundary
    for t in range(2):
        req.append_output_token_ids(t)
        mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    # 12 tokens: the state in block 1 is the checkpoint after 3 full blocks.
    assert mgr.get_block_ids("m") == ([0, 0, 1],)
    assert list(mgr.pool.cached[0].values()) == [1]
    req.append_output_token_ids(9)
    mgr.allocate_slots(req, 1)
    assert mgr.get_block_ids("m") == ([0, 0, 1, 2],)
    req.num_computed_tokens += 1
    req.append_output_token_ids(9)
    mgr.allocate_slots(req, 1)
    # The checkpoint fell behind the live state: freed, still cached.
    assert mgr.get_block_ids("m") == ([0, 0, 0, 2],)
    assert mgr.pool.is_free(1) and mgr.pool.cached[0]
    hit, n = mgr.get_computed_blocks(Request("n", [*tokens(0, 10), 0, 1, 5]))
    assert n == 12 and hit.get_block_ids() == ([0, 0, 1],)


def test_spec_types_map_to_their_managers():
    assert manager_class_for(FULL) is FullAttentionManager
    assert manager_class_for(MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)) is FullAttentionManager
    assert manager_class_for(window(8)) is SlidingWindowManager
    assert manager_class_for(mamba_spec()) is MambaManager
    with pytest.raises(TypeError, match="no block manager"):
        manager_class_for(object())
