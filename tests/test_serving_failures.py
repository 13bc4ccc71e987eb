"""Failure paths of the serving loop lose nothing: after any exception, or a host tier
that is full or failing, every block is accounted for and the prefix cache is exact
(later requests get the tokens of the dense forward)."""

import dataclasses
import threading

import numpy as np
import pytest

from jaxkv.device.metadata import Buckets
from jaxkv.errors import WrongThreadError
from jaxkv.models.tiny import TinyLM, dense_greedy_generate, get_model_config
from jaxkv.planner import KVCacheConfig, PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.serving.engine import Engine, EngineError
from jaxkv.serving.offload_connector import OffloadConfig

NEW_TOKENS = 4
MAX_MODEL_LEN = 320
ONE_SHAPE = Buckets((64,), (4,), (MAX_MODEL_LEN // 16,))


@pytest.fixture(scope="module")
def models() -> dict[str, TinyLM]:
    return {name: TinyLM(get_model_config(name), seed=0) for name in ("tiny-llama", "tiny-hybrid")}


def plan(model: TinyLM, num_blocks: int | None = None) -> KVCacheConfig:
    config = plan_kv_cache(
        model.config.layer_specs(), 4 << 20, max_model_len=MAX_MODEL_LEN, options=PlanOptions(max_num_batched_tokens=64)
    )
    return dataclasses.replace(config, num_blocks=num_blocks) if num_blocks else config


def engine(model: TinyLM, num_blocks: int | None = None, host_blocks: int | None = None, **offload) -> Engine:
    config = plan(model, num_blocks)
    tier = None
    if host_blocks is not None:
        block_bytes = config.pages.page_size_bytes * len(config.pages.layers)
        tier = OffloadConfig(host_blocks * block_bytes, **offload)
    return Engine(model, config, max_num_seqs=4, buckets=ONE_SHAPE, offload=tier)


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


def served(eng: Engine, batch: list[list[int]], **kwargs) -> list[list[int]]:
    return [list(o.output_token_ids) for o in eng.generate(batch, NEW_TOKENS, **kwargs).outputs]


def assert_nothing_leaked(eng: Engine) -> None:
    audit = eng.audit()
    assert (audit.device_blocks_leaked, audit.host_blocks_leaked) == (0, 0)
    assert eng.manager.num_requests == 0


@pytest.mark.parametrize("name, num_blocks, host_blocks", [("tiny-llama", 20, 8), ("tiny-hybrid", 64, 256)])
def test_a_full_host_tier_neither_crashes_nor_poisons_the_prefix(models, name, num_blocks, host_blocks):
    """The issue's repro: storing the blocks an admission reuses must not evict the host
    hit that admission is about to load."""
    model = models[name]
    eng = engine(model, num_blocks, host_blocks)
    a, b, c = prompts(11, 70, 150, 200)
    dense = dense_greedy_generate(model, [a, b, c], NEW_TOKENS)
    for prompt, expected in [(a, dense[0]), (b, dense[1]), (c, dense[2]), (a, dense[0]), (b, dense[1])]:
        assert served(eng, [prompt]) == [expected]
        assert_nothing_leaked(eng)


class Boom(Exception):
    pass


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_exception_inside_a_step_leaves_an_exact_prefix_cache(models, monkeypatch, name, error):
    fail_the_second_step_then_serve_exactly(models[name], engine(models[name], host_blocks=64), monkeypatch, error)


def fail_the_second_step_then_serve_exactly(model: TinyLM, eng: Engine, monkeypatch, error: type) -> None:
    """The second step raises after its blocks (and checkpoints) were allocated and
    cached, never written: nothing leaks, and the same batch then gets the dense tokens
    (twice: the second time from what the first full run cached)."""
    batch = prompts(5, 90, 70)
    batch.append(batch[0][:64] + batch[1][:20])
    dense = dense_greedy_generate(model, batch, NEW_TOKENS)
    execute = eng.runner.dispatch
    calls = iter(range(100))

    def failing_execute(chunks, rows, **kwargs):
        if next(calls) == 1:
            raise error("step failed")
        return execute(chunks, rows, **kwargs)

    monkeypatch.setattr(eng.runner, "dispatch", failing_execute)
    with pytest.raises(error):
        eng.generate(batch, NEW_TOKENS)
    assert_nothing_leaked(eng)
    monkeypatch.setattr(eng.runner, "dispatch", execute)
    assert served(eng, batch) == dense
    assert served(eng, batch) == dense
    assert_nothing_leaked(eng)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_exception_inside_a_recurrent_step_drops_the_states_it_would_have_written(monkeypatch, error):
    model = TinyLM(get_model_config("tiny-qwen3-next"), seed=0)
    config = plan_kv_cache(
        model.config.layer_specs(),
        8 << 20,
        max_model_len=MAX_MODEL_LEN,
        options=PlanOptions(
            max_num_batched_tokens=64,
            state_layout="state_pool",
            state_pool=StatePoolOptions(max_num_seqs=4, checkpoint_bytes=1 << 20),
        ),
    )
    fail_the_second_step_then_serve_exactly(
        model, Engine(model, config, max_num_seqs=4, buckets=ONE_SHAPE), monkeypatch, error
    )


def test_a_failing_progress_callback_leaves_the_engine_usable_and_exact(models):
    model = models["tiny-llama"]
    eng = engine(model)
    batch = prompts(6, 100, 100)
    dense = dense_greedy_generate(model, batch, NEW_TOKENS)

    def progress(p):
        if p.step == 2:
            raise Boom("callback failed")

    with pytest.raises(Boom):
        eng.generate(batch, NEW_TOKENS, progress=progress)
    assert_nothing_leaked(eng)
    assert served(eng, batch) == dense


def test_a_step_interrupted_after_donating_the_cache_starts_over_cleanly(models, monkeypatch):
    model = models["tiny-llama"]
    eng = engine(model)
    batch = prompts(8, 60)
    served(eng, batch)
    execute = eng.runner.dispatch

    def donate_then_fail(chunks, rows, **kwargs):
        execute(chunks, rows, **kwargs)
        for buf in eng.runner.cache.buffers:
            buf.delete()  # what an interrupt between dispatch and assignment leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(eng.runner, "dispatch", donate_then_fail)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(batch, NEW_TOKENS)
    monkeypatch.setattr(eng.runner, "dispatch", execute)
    assert_nothing_leaked(eng)
    result = eng.generate(batch, NEW_TOKENS)
    assert result.outputs[0].num_cached_tokens == 0  # the prefix cache was reset with the cache
    assert [list(result.outputs[0].output_token_ids)] == dense_greedy_generate(model, batch, NEW_TOKENS)


@pytest.mark.parametrize("store", ["on_eviction", "write_through"])
def test_a_failed_host_load_recomputes_on_a_sliding_window_model(models, store):
    """Bug 3: the fallback re-used a device hit whose window blocks the allocation evicted."""
    model = models["tiny-hybrid"]
    eng = engine(model, 64, 256, store=store, fail_load=lambda ids, host: np.ones(len(ids), bool))
    a, b = prompts(12, 150, 200)
    dense = dense_greedy_generate(model, [a, b], NEW_TOKENS)
    for prompt, expected in [(a, dense[0]), (b, dense[1]), (a, dense[0]), (b, dense[1])]:
        assert served(eng, [prompt]) == [expected]
        assert_nothing_leaked(eng)
    assert eng.connector.stats.num_failed_loads > 0


def test_different_cache_salts_never_share_blocks(models):
    eng = engine(models["tiny-llama"])
    [prompt] = prompts(13, 80)
    first = eng.generate([prompt], NEW_TOKENS, cache_salt="tenant-a").outputs[0]
    other = eng.generate([prompt], NEW_TOKENS, cache_salt="tenant-b").outputs[0]
    same = eng.generate([prompt, prompt], NEW_TOKENS, cache_salt=["tenant-a", None]).outputs
    assert other.num_cached_tokens == 0 and same[0].num_cached_tokens == 64 and same[1].num_cached_tokens == 0
    assert first.output_token_ids == other.output_token_ids == same[0].output_token_ids


def test_generate_from_another_thread_is_refused(models):
    eng = engine(models["tiny-llama"])
    errors = []

    def generate_elsewhere():
        with pytest.raises(WrongThreadError) as info:
            eng.generate([[1]], 1)
        errors.append(info.value)

    worker = threading.Thread(target=generate_elsewhere)
    worker.start()
    worker.join()
    assert len(errors) == 1


@pytest.mark.parametrize(
    "prompts_, max_new, match",
    [
        ([[1, 2]], 2.0, "max_new_tokens must be a positive int, got 2.0"),
        ([[1, 2]], None, "max_new_tokens must be a positive int, got None"),
        ([[1, 2]], True, "max_new_tokens must be a positive int, got True"),
        ([[True, 2]], 2, "True is not a token id"),
        ([np.zeros((2, 2), np.int32)], 2, "must be 1-D"),
        ((p for p in [[1, 2]]), 2, "prompts must be a list"),
        ([(t for t in [1, 2])], 2, "prompt 0 must be a sequence of token ids"),
        ([1, 2, 3], 2, "flat list of ints"),
        ([[1, 2]], [1, 2], "2 max_new_tokens values for 1 prompts"),
    ],
)
def test_bad_generate_arguments_get_an_engine_error(models, prompts_, max_new, match):
    eng = engine(models["tiny-llama"])
    with pytest.raises(EngineError, match=match):
        eng.generate(prompts_, max_new)
    assert_nothing_leaked(eng)


def test_numpy_limits_and_a_2d_prompt_array_are_accepted(models):
    eng = engine(models["tiny-llama"])
    batch = np.asarray(prompts(14, 20, 20))
    result = eng.generate(batch, np.int64(2))
    assert [len(o.output_token_ids) for o in result.outputs] == [2, 2]


@pytest.mark.parametrize("transfer", ["load_blocks", "store_blocks"])
def test_a_transfer_that_raises_leaves_every_block_accounted_for(models, monkeypatch, transfer):
    """An exception inside a host load (admission) or store (on eviction) frees what the
    request got, settles the host keys it had claimed, and the next calls are exact."""
    model = models["tiny-llama"]
    eng = engine(model, 20, 64)
    a, b, c = prompts(11, 70, 150, 200)
    dense = dense_greedy_generate(model, [a, b, c], NEW_TOKENS)
    original = getattr(eng.runner, transfer)
    calls = []

    def raising(*args):
        calls.append(args)
        raise Boom(f"{transfer} failed")

    monkeypatch.setattr(eng.runner, transfer, raising)
    with pytest.raises(Boom):
        for prompt in (a, b, c, a):
            served(eng, [prompt])
    assert calls and eng.connector.offload.num_keys_by_state()["pinned"] == 0
    assert_nothing_leaked(eng)
    monkeypatch.setattr(eng.runner, transfer, original)
    for prompt, expected in [(a, dense[0]), (b, dense[1]), (c, dense[2]), (a, dense[0])]:
        assert served(eng, [prompt]) == [expected]
        assert_nothing_leaked(eng)
