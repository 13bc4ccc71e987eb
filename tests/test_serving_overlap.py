"""Asynchronous scheduling (the overlapped loop) gives the synchronous loop's tokens.

Each test runs the same requests through an engine with ``async_scheduling`` on and off
(the same model object, so both share their compilations) and requires identical
tokens, and every block back; plus the rules the one-step lag must keep: a block is
cached only once its tokens are known, a sequence stopped or aborted with a step in
flight drops that step's token, an exception between dispatch and read-back loses nothing.
"""

import dataclasses

import numpy as np
import pytest

from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import KVCacheConfig, PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.serving.engine import CacheAudit, Engine, GenerationResult
from jaxkv.serving.offload_connector import OffloadConfig
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.scheduler import Scheduler

MAX_MODEL_LEN = 256
ONE_SHAPE = Buckets((64,), (4,), (MAX_MODEL_LEN // 16,))


@pytest.fixture(scope="module")
def models() -> dict[str, TinyLM]:
    return {name: TinyLM(get_model_config(name), seed=0) for name in ("tiny-llama", "tiny-qwen3-next")}


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 512, 24).tolist()  # a shared prefix: later prompts hit it
    return [(shared if i % 2 else []) + rng.integers(0, 512, n).tolist() for i, n in enumerate(lengths)]


def plan(model: TinyLM, memory_bytes: int = 4 << 20, num_blocks: int = 24, **options) -> KVCacheConfig:
    """A 64-token step budget; ``num_blocks`` (one max_model_len request and a few more
    blocks: a batch preempts) for every tiny-llama engine here, so they share one compilation."""
    config = plan_kv_cache(
        model.config.layer_specs(),
        memory_bytes,
        max_model_len=MAX_MODEL_LEN,
        options=PlanOptions(max_num_batched_tokens=64, **options),
    )
    return dataclasses.replace(config, num_blocks=num_blocks) if num_blocks else config


def state_pool_plan(model: TinyLM) -> KVCacheConfig:
    """A recurrent hybrid's plan with a state pool of its own (checkpoints in 1 MiB)."""
    return plan(
        model,
        8 << 20,
        num_blocks=0,
        state_layout="state_pool",
        state_pool=StatePoolOptions(max_num_seqs=4, checkpoint_bytes=1 << 20),
    )


def engine(model: TinyLM, config: KVCacheConfig, async_scheduling: bool, **kwargs) -> Engine:
    return Engine(model, config, max_num_seqs=4, buckets=ONE_SHAPE, async_scheduling=async_scheduling, **kwargs)


def outputs(result: GenerationResult) -> list[tuple]:
    """Each output in prompt order (ids aside: an engine numbers the requests it has seen)."""
    return [(o.index, list(o.output_token_ids), o.finish_reason, o.logprobs, o.text) for o in result.outputs]


def both(model: TinyLM, config: KVCacheConfig, batch, params, **kwargs) -> tuple[GenerationResult, GenerationResult]:
    """The batch through a synchronous and an asynchronous engine: the same outputs, nothing held after."""
    runs = []
    for mode in (False, True):
        eng = engine(model, config, mode, **kwargs)
        runs.append(eng.generate(batch, params))
        assert eng.audit() == CacheAudit(0, 0) and eng.manager.num_requests == 0
    sync, overlapped = runs
    assert outputs(overlapped) == outputs(sync)
    return sync, overlapped


def test_greedy_seeded_n_logprobs_min_tokens_and_stop_ids_give_the_same_tokens(models):
    model = models["tiny-llama"]
    batch = prompts(1, 30, 45, 17, 60, 9)
    free = engine(model, plan(model), False).generate(batch, 12)
    stop_id = free.outputs[0].output_token_ids[5]  # stops request 0 mid-way, with its next step in flight
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=3, logprobs=2),
        SamplingParams(max_tokens=6, n=3, temperature=0.8, seed=1),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=8, stop_token_ids=(stop_id,)),
        SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=7),
    ]
    sync, _ = both(model, plan(model), batch, params)
    assert sync.outputs[0].finish_reason == "stop" and len(sync.outputs[0].output_token_ids) == 6
    assert [o.index for o in sync.outputs if o.request_id == sync.outputs[2].request_id] == [0, 1, 2]


def test_preemption_keeps_the_tokens(models):
    model = models["tiny-llama"]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=5) for t in (0.0, 1.0, 0.0, 0.7)]
    sync, overlapped = both(model, plan(model), prompts(2, 70, 60, 80, 65), params)
    assert sync.num_preemptions > 0 and overlapped.num_preemptions > 0


def test_stop_strings_cut_the_same_text(models):
    tokenizers = pytest.importorskip("tokenizers")
    from jaxkv.models.text import TextTokenizer

    alphabet = "abcdefghijklmnopqrstuvwxyz"
    vocab = {alphabet[i % 26] + "_" * (i // 26): i for i in range(512)}  # text: mostly letters
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    raw.decoder = tokenizers.decoders.Fuse()
    tok = TextTokenizer(raw)
    model = models["tiny-llama"]
    batch = prompts(3, 20, 33)
    text = engine(model, plan(model), False, tokenizer=tok).generate(batch, 16).outputs[0].text
    assert text is not None and len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,))
    sync, overlapped = both(model, plan(model), batch, params, tokenizer=tok)
    assert sync.outputs[0].finish_reason == "stop" and stop not in (sync.outputs[0].text or "x")
    assert [o.text for o in overlapped.outputs] == [o.text for o in sync.outputs]


def test_a_recurrent_hybrid_gives_the_same_tokens(models):
    model = models["tiny-qwen3-next"]
    config = state_pool_plan(model)
    batch = prompts(4, 40, 30, 45)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=2) for t in (0.0, 1.0, 0.0)]
    both(model, config, batch, params)
    both(model, config, [batch[1], batch[1]], params[:2])  # the second hits the first's checkpoints


def test_the_host_tier_gives_the_same_tokens_and_loads_back(models):
    model = models["tiny-llama"]
    config = plan(model)
    tier = OffloadConfig(64 * config.pages.page_size_bytes * len(config.pages.layers), store="write_through")
    batch = prompts(5, 60, 70, 50)
    runs = {}
    for mode in (False, True):
        eng = engine(model, config, mode, offload=tier)
        first = eng.generate(batch, 20)
        assert eng.reset_prefix_cache()
        again = eng.generate(batch, 20)  # every prompt block comes back from host
        assert outputs(again) == outputs(first)
        assert eng.connector is not None and eng.connector.stats.num_loaded_tokens > 0
        assert eng.audit() == CacheAudit(0, 0)
        runs[mode] = outputs(first)
    assert runs[True] == runs[False]


def test_an_abort_with_a_step_in_flight_frees_everything_and_the_others_keep_their_tokens(models):
    model = models["tiny-llama"]
    batch = prompts(6, 30, 40, 25)
    kept = {}
    for mode in (False, True):
        eng = engine(model, plan(model), mode)
        ids = [eng.add_request(p, 12) for p in batch]
        for _ in range(3):
            eng.step()
        assert eng.abort(ids[1])
        done, late = {}, []
        while eng.has_unfinished:
            step = eng.step()
            done.update((o.request_id, list(o.output_token_ids)) for o in step.finished)
            late += [d for d in step.deltas if d.request_id == ids[1] and d.finish_reason != "abort"]
        assert late == [] and set(done) == {ids[0], ids[2]}
        assert eng.audit() == CacheAudit(0, 0)
        kept[mode] = done
    assert kept[True] == kept[False]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_an_exception_between_dispatch_and_read_back_loses_nothing(models, monkeypatch, name):
    model = models[name]
    config = plan(model) if name == "tiny-llama" else state_pool_plan(model)  # decodes through state boundaries
    batch = prompts(7, 40, 50)
    expected = outputs(engine(model, config, False).generate(batch, 8))
    eng = engine(model, config, True)
    collect = eng.runner.collect
    calls = iter(range(100))

    def failing(step):
        if next(calls) == 2:  # a step is in flight behind the one that fails
            raise KeyboardInterrupt
        return collect(step)

    monkeypatch.setattr(eng.runner, "collect", failing)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(batch, 8)
    assert eng.audit() == CacheAudit(0, 0) and eng.manager.num_requests == 0
    monkeypatch.setattr(eng.runner, "collect", collect)
    assert outputs(eng.generate(batch, 8)) == expected
    assert outputs(eng.generate(batch, 8)) == expected  # from what the runs cached


def test_a_block_is_cached_only_once_its_last_token_is_known(models):
    """The decode that completes a block feeds a token the host does not know yet: the
    block is cached at the next step, when it is."""
    config = plan(models["tiny-llama"])
    size = config.groups[0].block_size
    manager = KVCacheManager(config)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, size))  # one token short of a block
    seq = scheduler.add_request(Request("r", prompt), 8)

    def hit(*tail: int) -> int:
        return manager.get_computed_blocks(Request("probe", prompt + list(tail)))[1]

    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    decode = scheduler.schedule()  # feeds the placeholder at position size - 1: the block is full
    assert [(c.num_computed_tokens, c.num_new_tokens, c.samples) for c in decode.chunks] == [(size - 1, 1, True)]
    assert seq.num_placeholders == 1 and hit(7, 7) == 0, "the block's last token is not known"
    scheduler.advance(decode)
    assert scheduler.resolve(prefill, [7]) == [] and seq.num_placeholders == 1
    scheduler.schedule()
    assert hit(7, 7) == size and hit(8, 7) == 0


def test_a_recurrent_hybrid_keeps_the_states_it_decodes_through(models):
    """A chat's next turn (prompt and outputs sent again) resumes from the last state the
    decode kept on a block boundary: as many cached tokens as the synchronous loop finds,
    with no step skipped for it (the decode through each boundary feeds its token in flight)."""
    model = models["tiny-qwen3-next"]
    config = state_pool_plan(model)
    [prompt] = prompts(5, 40)
    hits, steps = [], []
    for mode in (False, True):
        eng = engine(model, config, mode)
        steps.append(0)
        eng.add_step_observer(lambda _: steps.__setitem__(-1, steps[-1] + 1))
        first = eng.generate([prompt], 30).outputs[0]
        turn = eng.generate([prompt + list(first.output_token_ids)], 1)
        hits.append(turn.num_cached_prompt_tokens)
        assert eng.audit() == CacheAudit(0, 0)
    assert hits[1] == hits[0] == 64  # the boundary at 64 tokens, decoded through
    assert steps[1] == steps[0] + 2 > 2, steps  # the overlapped loop's last step of each call reads back alone


def test_a_state_on_a_block_boundary_is_kept_once_its_fed_token_is_read_back(models):
    """The decode that ends on a state block boundary feeds a token in flight (not skipped):
    the state is cached at the sequence's next allocation, before its next state is placed
    (a fresh row, the boundary's row left intact), as written yet dropped if that step
    fails; a sequence whose last decode ends there has it cached when its last token comes."""
    config = state_pool_plan(models["tiny-qwen3-next"])
    [group] = KVCacheManager(config).recurrent_group_ids()
    size = config.groups[group].block_size
    prompt = list(range(1, size))  # the first decode feeds position size - 1: it ends on the boundary

    def to_the_boundary(max_tokens: int, step: int) -> tuple[KVCacheManager, Scheduler, object, object]:
        manager = KVCacheManager(config)
        scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
        scheduler.add_request(Request("r", prompt), max_tokens)
        outputs = []
        for _ in range(2):
            with manager.step_transaction():
                outputs.append(scheduler.schedule())
                scheduler.advance(outputs[-1])
        prefill, decode = outputs
        assert [(c.num_computed_tokens, c.num_new_tokens) for c in decode.chunks] == [(size - 1, 1)]
        assert scheduler.resolve(prefill, [step]) == []
        return manager, scheduler, decode.chunks[0].block_ids[group][-1], decode

    def hit(manager: KVCacheManager, *tail: int) -> int:
        return manager.get_computed_blocks(Request("probe", prompt + list(tail)))[1]

    manager, scheduler, row, _ = to_the_boundary(8, 7)
    assert hit(manager, 7, 7) == 0, "not cached before the next allocation"
    with manager.step_transaction():
        [chunk] = scheduler.schedule().chunks
        assert hit(manager, 7, 7) == size  # written by the step dispatched before: a hit already
    assert chunk.block_ids[group][0] == row and chunk.block_ids[group][1] not in (0, row)
    assert hit(manager, 7, 7) == size and hit(manager, 8, 7) == 0

    manager, scheduler, row, _ = to_the_boundary(8, 7)
    with pytest.raises(KeyboardInterrupt), manager.step_transaction():
        scheduler.schedule()
        raise KeyboardInterrupt  # the step that wrote the state fails as it is read back
    assert hit(manager, 7, 7) == 0

    manager, scheduler, row, decode = to_the_boundary(2, 7)  # its decode draws its last token
    with manager.step_transaction():
        assert scheduler.schedule().chunks == ()
    assert [s.request_id for s in scheduler.resolve(decode, [9])] == ["r"]
    assert hit(manager, 7, 9) == size and manager.num_requests == 0
