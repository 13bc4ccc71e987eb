"""Shared builders for hand-made KV cache configs, and the seeded random generator.

The CPU backend gets 8 devices (tensor-parallel tests build meshes of 1, 2, 4 and 8 of
them); the flag must be set before jax is first imported, hence here, first. Everything
else keeps running on ``jax.devices()[0]``, the default device.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import secrets

import numpy as np
import pytest
from paged_batches import SeededRng

from jaxkv.manager import KVCacheManager, Request
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

FULL = FullAttentionSpec(num_kv_heads=1, head_size=1)


def window(w: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=1, head_size=1, sliding_window=w)


def make_config(num_blocks: int, *specs, block_size: int = 16) -> KVCacheConfig:
    """One group per spec, each with a single layer."""
    groups = tuple(
        KVCacheGroup(layer_names=(f"g{i}.layer",), spec=s, block_size=block_size) for i, s in enumerate(specs)
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def make_manager(num_blocks: int, *specs, block_size: int = 16, max_model_len: int = 8192, **kw) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *specs, block_size=block_size), max_model_len=max_model_len, **kw)


def admit(mgr: KVCacheManager, req: Request, num_lookahead_tokens: int = 0):
    """Look up the prefix cache and allocate the rest of the prompt, as a scheduler does."""
    hit, n = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - n, n, hit, num_lookahead_tokens=num_lookahead_tokens)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, n, new


@pytest.fixture
def tokens():
    """Deterministic distinct token runs: tokens(start, n)."""
    return lambda start, n: list(range(start, start + n))


def ragged_metadata(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_blocks: int,
    width: int,
    max_seqs: int,
) -> dict[str, np.ndarray]:
    """Paged-attention metadata for (q_len, kv_len) sequences (decodes first), padded
    to fixed shapes: distinct random non-null blocks, unused table entries 0."""
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((max_seqs, width), np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    used = 0
    for i, (q_len, kv_len) in enumerate(seqs):
        n = -(-kv_len // block_size)
        tables[i, :n] = ids[used : used + n]
        used += n
        kv_lens[i] = kv_len
        cu[i + 1] = cu[i] + q_len
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    return dict(kv_lens=kv_lens, block_tables=tables, cu_q_lens=cu, num_seqs=np.array([len(seqs)], np.int32))


@pytest.fixture
def rng() -> SeededRng:
    """Fresh random inputs for every case (JAXKV_TEST_SEED replays one)."""
    return SeededRng(int(os.environ.get("JAXKV_TEST_SEED", secrets.randbits(32))))
