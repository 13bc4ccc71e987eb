"""Serving loop with the host offload tier: blocks evicted from the device and loaded
back from host give exactly the tokens of a cold run, with injected failures too, for
both store policies."""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core.manager import Request
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, dense_greedy_generate, get_model_config
from jaxkv.offload.catalog import PolicyOffloadingManager
from jaxkv.offload.transfer import TransferEngine
from jaxkv.planner import PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.offload_connector import STORE_POLICIES, ConnectorError, OffloadConfig
from jaxkv.specs import FullAttentionSpec

NEW_TOKENS = 6
ONE_SHAPE = Buckets((64,), (4,), (16,))
LAYOUTS = ("cross_layer", "per_layer")


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(get_model_config("tiny-hybrid"), seed=0)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(3).integers(0, 512, 100).tolist()


@pytest.fixture(scope="module")
def cold(model, prompt) -> list[int]:
    return dense_greedy_generate(model, [prompt], NEW_TOKENS)[0]


def engine(model: TinyLM, layout: str, *, memory_bytes: int = 4 << 20, **offload) -> Engine:
    plan = plan_kv_cache(
        model.config.layer_specs(),
        memory_bytes,
        max_model_len=256,
        options=PlanOptions(layout=layout, max_num_batched_tokens=64),
    )
    return Engine(model, plan, max_num_seqs=4, buckets=ONE_SHAPE, offload=OffloadConfig(2 << 20, **offload))


def evict_device(eng: Engine) -> None:
    """Reuse every free device block, as a full device would, then zero the cache data:
    only the host tier can serve a hit (stored on eviction, or earlier)."""
    pool = eng.manager.pool
    taken = pool.get_new_blocks(pool.num_free_blocks)
    eng.connector.before_step()
    pool.free_blocks(taken)
    eng.connector.finish_stores()
    assert pool.num_cached_blocks() == 0
    eng.runner.cache = jax.tree.map(jnp.zeros_like, eng.runner.cache)


def device_blocks_from(eng: Engine, prompt: list[int], first: int) -> set[int]:
    """Device blocks caching ``prompt``'s blocks ``first..`` in any group."""
    req = Request("probe", prompt)
    eng.manager.hash_request(req)
    cached = eng.manager.pool.cached
    return {
        cached[g][h]
        for g, hashes in enumerate(eng.manager.coordinator.hashes_per_group(req.block_hashes))
        for h in hashes[first:]
        if h in cached[g]
    }


def rerun(eng: Engine, prompt: list[int]) -> tuple[list[int], list[int], int]:
    """Tokens of a first run, of a run after evicting the device, and its cached tokens."""
    first = eng.generate([prompt], NEW_TOKENS).outputs[0]
    evict_device(eng)
    second = eng.generate([prompt], NEW_TOKENS).outputs[0]
    return list(first.output_token_ids), list(second.output_token_ids), second.num_cached_tokens


@pytest.mark.parametrize("store", STORE_POLICIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_loaded_back_from_host_give_the_cold_tokens(model, prompt, cold, layout, store):
    eng = engine(model, layout, store=store)
    first, second, cached = rerun(eng, prompt)
    stats = eng.connector.stats
    assert first == second == cold
    assert cached == 96 and stats.num_loaded_tokens == 96
    num_groups = len(eng.manager.config.groups)
    full_groups = sum(isinstance(g.spec, FullAttentionSpec) for g in eng.manager.config.groups)
    # Full-attention groups load all 6 blocks, sliding-window groups only the 2 in the window.
    assert full_groups == 1 and stats.num_loaded_blocks == 6 * full_groups + 2 * (num_groups - full_groups)
    assert stats.num_stored_blocks > 0 and stats.num_failed_stores == stats.num_failed_loads == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_loads_recompute(model, prompt, cold, layout):
    eng = engine(model, layout, fail_load=lambda ids, slots: np.arange(len(ids)) % 2 == 1)
    first, second, cached = rerun(eng, prompt)
    assert first == second == cold
    assert cached == 0 and eng.connector.stats.num_failed_loads == 1
    assert eng.connector.stats.num_loaded_tokens == 0


@pytest.mark.parametrize("fail_load", [None, lambda ids, slots: np.arange(len(ids)) % 2 == 1])
def test_the_step_after_a_host_load_is_dispatched_without_waiting_for_it(model, prompt, cold, monkeypatch, fail_load):
    """No load is waited for: admission reads each load's outcome at issue (failures
    included), and the step reads the loaded blocks in device order."""
    waited = []
    wait = TransferEngine.wait
    monkeypatch.setattr(TransferEngine, "wait", lambda self, t: waited.append(t.kind) or wait(self, t))
    eng = engine(model, "cross_layer", fail_load=fail_load)
    first, second, cached = rerun(eng, prompt)
    stats = eng.connector.stats
    assert first == second == cold
    assert (cached, stats.num_failed_loads) == ((0, 1) if fail_load else (96, 0))
    assert "store" in waited and "load" not in waited
    assert eng.audit() == type(eng.audit())(0, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_stores_leave_blocks_unstored(model, prompt, cold, layout):
    failing: set[int] = set()
    eng = engine(model, layout, fail_store=lambda ids, slots: np.isin(ids, list(failing)))
    first = list(eng.generate([prompt], NEW_TOKENS).outputs[0].output_token_ids)
    failing |= device_blocks_from(eng, prompt, 4)  # stores of blocks 4.. (tokens 64..) fail
    evict_device(eng)
    out = eng.generate([prompt], NEW_TOKENS).outputs[0]
    second, cached = list(out.output_token_ids), out.num_cached_tokens
    stats = eng.connector.stats
    assert first == second == cold
    assert stats.num_failed_stores > 0 and stats.num_failed_loads == 0
    assert cached == stats.num_loaded_tokens == 64


def test_small_device_pool_with_host_tier_keeps_the_tokens(model):
    """Shared prefixes in a device pool too small to keep them: host hits, identical tokens."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 512, 64).tolist()
    prompts = [shared + rng.integers(0, 512, 20).tolist() for _ in range(3)]
    block_bytes = plan_kv_cache(model.config.layer_specs(), 1 << 30, max_model_len=64).pages.block_bytes
    eng = engine(model, "cross_layer", memory_bytes=52 * block_bytes)
    outputs = []
    for p in prompts:  # one at a time, each followed by a filler evicting the device cache
        outputs.append(list(eng.generate([p], NEW_TOKENS).outputs[0].output_token_ids))
        eng.generate([rng.integers(0, 512, 200).tolist()], 1)
    assert outputs == dense_greedy_generate(model, prompts, NEW_TOKENS)
    assert eng.connector.stats.num_loaded_tokens >= 2 * 64


def test_write_through_stores_filled_blocks_on_eviction_waits_for_reuse(model, prompt):
    through, on_eviction = (engine(model, "cross_layer", store=store) for store in STORE_POLICIES[::-1])
    for eng in (through, on_eviction):
        eng.generate([prompt], NEW_TOKENS)
        eng.connector.finish_stores()
    assert through.connector.stats.num_stored_blocks > 0
    assert on_eviction.connector.stats.num_stored_blocks == 0
    evict_device(on_eviction)
    assert on_eviction.connector.stats.num_stored_blocks == len(on_eviction.connector.offload) > 0


def test_write_through_evicts_host_blocks_the_device_holds_first_and_stores_them_when_reused(model):
    """A full write-through host tier keeps the blocks only it holds, evicts those the device
    still caches, and gets them back when the device reuses them: a later hit is exact."""
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 512, 100).tolist() for _ in range(3))
    plan = plan_kv_cache(
        model.config.layer_specs(), 4 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    eng = Engine(model, plan, max_num_seqs=4, buckets=ONE_SHAPE, offload=OffloadConfig(48 << 14, store="write_through"))
    host = eng.connector.offload
    assert eng.connector.num_host_blocks == 48 and eng.connector.transfers.buffers.block_bytes == 1 << 14

    def on_host() -> set:
        return set(cast(PolicyOffloadingManager, host).policy.resident())

    eng.generate([a], NEW_TOKENS)
    eng.connector.finish_stores()
    a_keys = on_host()
    evict_device(eng)  # a only on host now
    first_b = eng.generate([b], NEW_TOKENS).outputs[0].output_token_ids
    eng.connector.finish_stores()
    a_left, b_keys = on_host() & a_keys, on_host() - a_keys
    assert len(a_keys) == len(b_keys) == 36 and len(a_left) == 12  # LRU took a's others: not on device
    eng.generate([c], NEW_TOKENS)
    eng.connector.finish_stores()
    assert a_left <= on_host() and not b_keys & on_host()  # b's blocks went first: the device has them
    evict_device(eng)  # the device reuses b's blocks: stored again
    assert b_keys <= on_host()
    second_b = eng.generate([b], NEW_TOKENS).outputs[0]
    assert second_b.num_cached_tokens == 96 and second_b.output_token_ids == first_b
    assert eng.connector.num_leaked_host_blocks() == 0


def test_unknown_store_policy_is_named(model):
    plan = plan_kv_cache(
        model.config.layer_specs(), 4 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    with pytest.raises(ConnectorError, match="'lazy'"):
        Engine(model, plan, offload=OffloadConfig(1 << 20, store="lazy"))


def test_offload_needs_prefix_caching(model):
    plan = plan_kv_cache(
        model.config.layer_specs(), 4 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    with pytest.raises(ConnectorError, match="enable_caching"):
        Engine(model, plan, enable_caching=False, offload=OffloadConfig(1 << 20))


# ------------------------------------------------------------------ recurrent state
@pytest.fixture(scope="module")
def qwen3_next() -> TinyLM:
    return TinyLM(get_model_config("tiny-qwen3-next"), seed=0)


def recurrent_engine(
    model: TinyLM, state_layout: str, store: str = "on_eviction", layout: str = "cross_layer", **offload
) -> Engine:
    """A device pool that four ~250-token prompts served one at a time overflow, so blocks
    and checkpoints go out to an 8 MiB host tier: 32 attention blocks and 4 state rows
    (2 live) with a state pool, 1.5 MiB of 32-token pages holding states under vLLM's rule,
    1.5 MiB of 16-token blocks with states of 4 blocks each in one memory (shared pages)."""
    pooled = state_layout == "state_pool"
    plan = plan_kv_cache(
        model.config.layer_specs(),
        3 << 19,
        max_model_len=320,
        options=PlanOptions(
            max_num_batched_tokens=64,
            state_layout=state_layout,
            layout=layout,
            state_pool=StatePoolOptions(max_num_seqs=2, checkpoint_bytes=128 << 10) if pooled else None,
        ),
    )
    tier = OffloadConfig(8 << 20, store=store, **offload)
    return Engine(model, plan, max_num_seqs=2, buckets=Buckets((64,), (2,), (20,)), offload=tier)


@pytest.mark.parametrize(
    "state_layout, store, fail_rate, layout",
    [
        (state_layout, store, fail_rate, "cross_layer")
        for state_layout in ("state_pool", "attention_pages")
        for store in STORE_POLICIES
        for fail_rate in (0.0, 0.5)
    ]
    + [("shared_pages", store, 0.0, "cross_layer") for store in STORE_POLICIES]
    + [
        ("shared_pages", "on_eviction", 0.5, "cross_layer"),
        ("state_pool", "on_eviction", 0.5, "per_layer"),
        ("attention_pages", STORE_POLICIES[0], 0.0, "per_layer"),
    ],
)
def test_recurrent_checkpoints_go_to_host_and_come_back_with_the_cold_tokens(
    qwen3_next, state_layout, store, fail_rate, layout
):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (290, 250, 220, 270)]
    cold = dense_greedy_generate(qwen3_next, prompts, NEW_TOKENS)
    failures = np.random.default_rng(1)
    eng = recurrent_engine(
        qwen3_next, state_layout, store, layout, fail_load=lambda ids, host: failures.random(len(ids)) < fail_rate
    )
    for _ in range(2):
        for prompt, expected in zip(prompts, cold, strict=False):
            assert [list(o.output_token_ids) for o in eng.generate([prompt], NEW_TOKENS).outputs] == [expected]
            assert (eng.audit().device_blocks_leaked, eng.audit().host_blocks_leaked) == (0, 0)
    stats = eng.connector.stats
    assert stats.num_stored_blocks > 0
    assert stats.num_loaded_states > 0 if fail_rate == 0 else stats.num_failed_loads > 0
