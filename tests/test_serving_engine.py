"""Engine end to end: greedy tokens identical with prefix caching on, off and the dense oracle."""

import numpy as np
import pytest

from jaxkv import ops
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, dense_greedy_generate, get_model_config
from jaxkv.planner import TPU_HEAD_DIM_MULTIPLE, PlanOptions, StatePoolOptions, default_state_layout, plan_kv_cache
from jaxkv.serving.engine import (
    CacheAudit,
    Engine,
    EngineError,
    GenerationResult,
    resolve_head_dim_multiple,
)
from jaxkv.serving.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
NEW_TOKENS = 10
ONE_SHAPE = Buckets((64,), (4,), (16,))


def workload() -> list[list[int]]:
    """Prompts sharing a 40-token prefix (2.5 blocks), a 20-token one, an exact duplicate,
    one longer than the step budget (chunked) and one unrelated; all outgrow the window of 32."""
    rng = np.random.default_rng(7)

    def tail(n: int) -> list[int]:
        return rng.integers(0, 512, n).tolist()

    shared = tail(40)
    first = shared + tail(5)
    return [first, shared + tail(38), shared[:20] + tail(17), list(first), tail(33), shared + tail(1)]


@pytest.fixture(scope="module")
def models() -> dict[str, TinyLM]:
    return {name: TinyLM(get_model_config(name), seed=0) for name in ("tiny-llama", "tiny-hybrid")}


@pytest.fixture(scope="module")
def dense_tokens(models) -> dict[str, list[list[int]]]:
    return {name: dense_greedy_generate(m, workload(), NEW_TOKENS) for name, m in models.items()}


def engine(
    model: TinyLM,
    *,
    memory_bytes: int = 4 << 20,
    max_model_len: int = MAX_MODEL_LEN,
    layout: str = "cross_layer",
    buckets: Buckets | None = ONE_SHAPE,
    **kwargs,
) -> Engine:
    """An engine with a 64-token step budget and 4 sequences (one step shape unless ``buckets``)."""
    plan = plan_kv_cache(
        model.config.layer_specs(),
        memory_bytes,
        max_model_len=max_model_len,
        options=PlanOptions(layout=layout, max_num_batched_tokens=64),
    )
    return Engine(model, plan, max_num_seqs=4, buckets=buckets, **kwargs)


def tokens(result: GenerationResult) -> list[list[int]]:
    return [list(o.output_token_ids) for o in result.outputs]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_prefix_caching_on_off_and_dense_give_identical_tokens(models, dense_tokens, name, layout):
    cached = engine(models[name], layout=layout).generate(workload(), NEW_TOKENS)
    uncached = engine(models[name], layout=layout, enable_caching=False).generate(workload(), NEW_TOKENS)
    assert tokens(cached) == tokens(uncached) == dense_tokens[name]
    assert cached.num_cached_prompt_tokens >= 3 * 32 and cached.prefix_hit_rate > 0.3
    assert uncached.num_cached_prompt_tokens == 0
    assert cached.num_scheduled_tokens < uncached.num_scheduled_tokens
    assert all(len(set(t)) > 1 for t in tokens(cached))  # the model does not just repeat itself


@pytest.mark.parametrize(
    "name, num_blocks, max_model_len", [("tiny-llama", 9, 128), ("tiny-hybrid", 52, MAX_MODEL_LEN)]
)
def test_preemption_under_a_small_pool_keeps_the_tokens(models, dense_tokens, name, num_blocks, max_model_len):
    """The smallest pools that hold one max_model_len request: requests get preempted and recomputed."""
    block_bytes = plan_kv_cache(models[name].config.layer_specs(), 1 << 30, max_model_len=64).pages.block_bytes
    small = engine(models[name], memory_bytes=num_blocks * block_bytes, max_model_len=max_model_len)
    result = small.generate(workload(), NEW_TOKENS)
    assert result.num_preemptions > 0 and result.peak_usage > 0.9
    assert tokens(result) == dense_tokens[name]
    assert small.manager.num_free_blocks == small.manager.config.num_usable_blocks


def test_a_later_call_hits_the_prefix_cache_of_an_earlier_one(models, dense_tokens):
    eng = engine(models["tiny-hybrid"])
    prompts = workload()
    eng.generate(prompts[:1], 2)
    result = eng.generate(prompts[3:4], NEW_TOKENS)  # the same prompt again
    assert result.outputs[0].num_cached_tokens == 32
    assert tokens(result) == dense_tokens["tiny-hybrid"][3:4]


def test_no_recompilation_after_warm_up_in_a_200_step_run(models):
    eng = engine(models["tiny-hybrid"], buckets=None)  # default: decode-only and budget-sized steps
    warm = eng.generate(workload()[:2], 3)
    assert warm.num_compilations <= 2  # shapes other tests compiled are reused
    rng = np.random.default_rng(1)
    run = eng.generate([rng.integers(0, 512, n).tolist() for n in (20, 33, 47, 5)], 220)
    assert run.num_steps >= 200 and run.num_compilations == 0
    assert eng.runner.num_compilations <= 2


def test_the_xla_attention_path_gives_the_same_tokens(models, dense_tokens):
    with ops.set_implementation("xla_gpu"):
        result = engine(models["tiny-hybrid"]).generate(workload(), NEW_TOKENS)
    assert tokens(result) == dense_tokens["tiny-hybrid"]


def test_heads_padded_to_128_lanes_give_the_same_tokens(dense_tokens):
    """tiny-llama's heads of 64 in a cache padded to 128 (as on TPU): half the blocks, same tokens."""
    prompts = workload()[:3]
    kw = dict(
        memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=4, buckets=ONE_SHAPE
    )
    plain = Engine.build("tiny-llama", plan=PlanOptions(head_dim_multiple=1), **kw)
    tiled = Engine.build("tiny-llama", plan=PlanOptions(head_dim_multiple=TPU_HEAD_DIM_MULTIPLE), **kw)
    assert (plain.runner.cache.head_dim, tiled.runner.cache.head_dim) == (64, 128)
    assert tiled.manager.config.num_blocks == plain.manager.config.num_blocks // 2
    expected = dense_tokens["tiny-llama"][: len(prompts)]
    assert tokens(tiled.generate(prompts, NEW_TOKENS)) == tokens(plain.generate(prompts, NEW_TOKENS)) == expected


def test_heads_are_padded_by_default_on_tpu_only(monkeypatch):
    assert resolve_head_dim_multiple(None) == 1  # CPU
    assert resolve_head_dim_multiple(8) == 8
    monkeypatch.setattr("jax.default_backend", lambda: "tpu")
    assert resolve_head_dim_multiple(None) == TPU_HEAD_DIM_MULTIPLE == 128
    assert resolve_head_dim_multiple(1) == 1


def test_results_report_progress_timing_and_usage(models):
    seen = []
    result = engine(models["tiny-hybrid"]).generate(workload()[:3], [2, 3, 4], progress=seen.append)
    assert [p.step for p in seen] == list(range(1, result.num_steps + 1))
    assert seen[-1].num_finished == 3 and seen[-1].num_running == seen[-1].num_waiting == 0
    assert [len(o.output_token_ids) for o in result.outputs] == [2, 3, 4]
    assert all(0 < o.ttft_s <= o.finish_s <= result.wall_s for o in result.outputs)
    assert 0 < result.mean_usage <= result.peak_usage <= 1
    assert result.num_generated_tokens == 9 and result.output_tokens_per_s > 0
    report = result.to_dict()
    assert report["outputs"][0]["request_id"] == result.outputs[0].request_id
    assert report["prefix_hit_rate"] == result.prefix_hit_rate


def test_step_check_sees_every_step_before_it_runs_then_the_end(models):
    seen = []
    eng = engine(models["tiny-llama"], step_check=seen.append)
    result = eng.generate(workload()[:3], 3)
    assert len(seen) == result.num_steps + 1 and seen[-1] is None
    assert sum(out.num_tokens for out in seen[:-1]) == result.num_scheduled_tokens


def test_a_refusing_step_check_aborts_the_call_before_the_device_and_leaks_nothing(models):
    class Refused(Exception):
        pass

    def refuse_second_step(output):
        if output is not None and output.chunks[0].num_computed_tokens:
            raise Refused

    eng = engine(models["tiny-llama"], step_check=refuse_second_step)
    ran = []
    with pytest.raises(Refused):
        eng.generate(workload()[:2], 3, progress=ran.append)
    assert len(ran) == 1
    assert eng.audit().device_blocks_leaked == 0


@pytest.mark.parametrize(
    "prompts, max_new, match",
    [
        ([], 2, "at least one prompt"),
        ([[1, 2], []], 2, "prompt 1 is empty"),
        ([[1, 2], 3], 2, "prompt 1 must be a sequence of token ids, got 3"),
        ([[1, 512]], 2, r"prompt 0: token 512 is not an id in \[0, 512\)"),
        ([[1, -1]], 2, "token id -1"),
        ([list(range(MAX_MODEL_LEN))], 2, "prompt 0 has 256 tokens; max_model_len=256"),
        ([[1], [2]], [1], "1 max_new_tokens values for 2 prompts"),
        ([[1]], 0, "max_new_tokens must be a positive int, got 0"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(models, prompts, max_new, match):
    eng = engine(models["tiny-llama"])
    with pytest.raises(EngineError, match=match):
        eng.generate(prompts, max_new)
    assert eng.manager.num_free_blocks == eng.manager.config.num_usable_blocks
    assert eng.runner.num_compilations == 0


def test_the_step_budget_may_not_exceed_the_plan(models):
    specs = models["tiny-llama"].config.layer_specs()
    plan = plan_kv_cache(specs, 4 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64))
    with pytest.raises(EngineError, match="max_num_batched_tokens=128 exceeds the plan's max_num_batched_tokens=64"):
        Engine(models["tiny-llama"], plan, max_num_batched_tokens=128)


def test_an_engine_plans_its_own_cache_from_memory_and_length_or_takes_a_plan(models):
    model = models["tiny-hybrid"]
    eng = Engine(model, memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)
    assert eng.manager.config.max_model_len == MAX_MODEL_LEN and eng.max_num_batched_tokens == 256
    assert {n for g in eng.manager.config.groups for n in g.layer_names} == set(model.layer_specs())
    plan = eng.manager.config
    with pytest.raises(EngineError, match="memory_bytes=None, max_model_len=256"):
        Engine(model, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(EngineError, match="a kv_config is one already"):
        Engine(model, plan, memory_bytes=4 << 20)


# ------------------------------------------------------------------ recurrent hybrid
@pytest.fixture(scope="module")
def qwen3_next() -> tuple[TinyLM, list[list[int]]]:
    model = TinyLM(get_model_config("tiny-qwen3-next"), seed=0)
    return model, dense_greedy_generate(model, workload(), NEW_TOKENS)


def recurrent_engine(
    model: TinyLM, state_layout: str, *, max_num_seqs: int = 4, layout: str = "cross_layer", **kwargs
) -> Engine:
    """A 64-token step budget in 8 MiB (or ``memory_bytes``); the state pool sized for
    ``max_num_seqs`` live states + 1 MiB of checkpoints."""
    pooled = state_layout == "state_pool"
    checkpoint_bytes = kwargs.pop("checkpoint_bytes", 1 << 20)
    plan = plan_kv_cache(
        model.config.layer_specs(),
        kwargs.pop("memory_bytes", 8 << 20),
        max_model_len=MAX_MODEL_LEN,
        options=PlanOptions(
            max_num_batched_tokens=64,
            layout=layout,
            state_layout=state_layout,
            state_pool=StatePoolOptions(max_num_seqs, checkpoint_bytes) if pooled else None,
        ),
    )
    return Engine(model, plan, max_num_seqs=4, buckets=ONE_SHAPE, **kwargs)


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
@pytest.mark.parametrize("state_layout", ["shared_pages", "state_pool", "attention_pages"])
def test_a_recurrent_hybrid_gives_the_dense_tokens_with_caching_on_and_off(qwen3_next, state_layout, layout):
    model, dense = qwen3_next
    # 2 MiB of state pool checkpoints (16 rows): the batch's junction, resend and continuation checkpoints
    eng = recurrent_engine(model, state_layout, layout=layout, checkpoint_bytes=2 << 20)
    cached = eng.generate(workload(), NEW_TOKENS)
    again = eng.generate(workload(), NEW_TOKENS)  # now every prompt's checkpoints are cached
    uncached = recurrent_engine(model, state_layout, layout=layout, enable_caching=False).generate(
        workload(), NEW_TOKENS
    )
    assert tokens(cached) == tokens(again) == tokens(uncached) == dense
    assert uncached.num_cached_prompt_tokens == 0
    if state_layout != "attention_pages":  # 16-token checkpoints: the duplicate prompt and the reruns hit
        assert cached.num_cached_prompt_tokens >= 32 and again.prefix_hit_rate > 0.6
    assert eng.audit().device_blocks_leaked == 0


def test_a_recurrent_hybrid_short_of_state_slots_runs_two_at_once_without_preemption(qwen3_next):
    """Two live states for a batch of six: each running request needs its live state
    alone (a checkpoint it would read is written over: no room is left for it), so two
    run at once and none is preempted."""
    model, dense = qwen3_next
    eng = recurrent_engine(model, "state_pool", max_num_seqs=2, checkpoint_bytes=0)
    assert eng.manager.state_pool.num_blocks == 3
    result = eng.generate(workload(), NEW_TOKENS)
    assert result.num_preemptions == 0 and tokens(result) == dense
    assert eng.audit().device_blocks_leaked == 0


def test_a_recurrent_hybrid_short_of_shared_pages_preempts_and_keeps_the_tokens(qwen3_next):
    """One memory of 24 blocks: a max_model_len request's 16 KV blocks and its 4-block state
    fit, four running requests with their states and checkpoints do not."""
    model, dense = qwen3_next
    eng = recurrent_engine(model, "shared_pages", memory_bytes=24 * 32 << 10)
    assert eng.manager.config.num_blocks == 24 and eng.manager.config.shared_states.pages_per_state == 4
    result = eng.generate(workload(), NEW_TOKENS)
    again = eng.generate(workload(), NEW_TOKENS)
    assert result.num_preemptions > 0 and tokens(result) == tokens(again) == dense
    assert eng.audit().device_blocks_leaked == 0


@pytest.mark.parametrize("state_layout", ["shared_pages", "state_pool"])
def test_a_recurrent_hybrid_compiles_once_per_step_shape(qwen3_next, state_layout):
    model, _ = qwen3_next
    eng = recurrent_engine(model, state_layout)
    eng.generate(workload()[:2], 2)
    run = eng.generate(workload()[2:], 30)
    assert run.num_steps >= 30 and run.num_compilations == 0


def test_a_request_added_between_steps_joins_the_running_batch(models, dense_tokens):
    model = models["tiny-llama"]
    eng = engine(model)
    first, *rest = workload()
    eng.add_request(first, NEW_TOKENS, request_id="first")
    eng.step()
    eng.step()
    assert eng.num_running == 1
    late = eng.add_request(rest[0], NEW_TOKENS)
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 0  # admitted beside "first", which still runs
    outputs = {}
    while eng.has_unfinished:
        outputs.update((o.request_id, list(o.output_token_ids)) for o in eng.step().finished)
    assert outputs == {"first": dense_tokens["tiny-llama"][0], late: dense_tokens["tiny-llama"][1]}
    assert eng.audit().device_blocks_leaked == 0


def test_generate_refuses_to_run_beside_added_requests(models):
    eng = engine(models["tiny-llama"])
    eng.add_request(workload()[0], 2, request_id="a")
    with pytest.raises(EngineError, match="1 added requests are unfinished"):
        eng.generate(workload()[:1], 2)
    with pytest.raises(EngineError, match="request_id must be a str not already unfinished, got 'a'"):
        eng.add_request(workload()[1], 2, request_id="a")
    assert eng.num_waiting == 1 and eng.reset_prefix_cache() is False


# ------------------------------------------------------------------ one request aborted
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_abort_frees_one_request_and_the_others_finish_with_their_tokens(models, dense_tokens, name):
    from jaxkv.serving.offload_connector import OffloadConfig

    eng = engine(models[name], offload=OffloadConfig(1 << 20, store="write_through"))
    prompts = workload()
    keep = eng.add_request(prompts[0], NEW_TOKENS)
    gone = eng.add_request(prompts[1], NEW_TOKENS)
    eng.step()
    assert eng.abort(gone) and not eng.abort(gone) and not eng.abort("unknown")
    outputs = []
    while eng.has_unfinished:
        outputs += eng.step().finished
    assert [o.request_id for o in outputs] == [keep]
    assert list(outputs[0].output_token_ids) == dense_tokens[name][0]
    assert eng.audit() == CacheAudit(0, 0), "the aborted request's blocks, states and host blocks are all back"
    again = eng.generate([prompts[1]], NEW_TOKENS)
    assert tokens(again) == [dense_tokens[name][1]], "the prefix cache stayed exact"


def test_abort_of_an_n_request_before_its_first_token_aborts_every_sibling(models):
    """Issue 41, finding 1: the siblings held until the first sequence's first token made
    ``abort`` raise KeyError."""
    eng = engine(models["tiny-llama"])
    rid = eng.add_request(workload()[0], SamplingParams(n=3, seed=1, max_tokens=4))
    assert eng.abort(rid) and not eng.abort(rid) and not eng.has_unfinished
    step = eng.step()
    assert sorted((d.index, d.finish_reason) for d in step.deltas) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert eng.audit() == CacheAudit(0, 0)


@pytest.mark.parametrize("hook", ["progress", "step_check"])
def test_abort_from_a_progress_callback_or_a_step_check_drops_the_request_and_the_call_goes_on(
    models, dense_tokens, hook
):
    """Both raised KeyError: generate looked up the aborted request's output, and a step
    went on with a chunk of the request abort had just taken out."""
    prompts = workload()[:2]
    aborted = []

    def abort_once(progress_or_output) -> None:
        if progress_or_output is not None and not aborted:
            aborted.append(eng.abort("req-1"))

    if hook == "progress":
        eng = engine(models["tiny-llama"])
        result = eng.generate(prompts, NEW_TOKENS, progress=abort_once)
    else:
        eng = engine(models["tiny-llama"], step_check=abort_once)
        result = eng.generate(prompts, NEW_TOKENS)
    assert aborted == [True] and [o.request_id for o in result.outputs] == ["req-0"]
    assert tokens(result) == [dense_tokens["tiny-llama"][0]] and eng.audit() == CacheAudit(0, 0)
    assert tokens(eng.generate([prompts[1]], NEW_TOKENS)) == [dense_tokens["tiny-llama"][1]], "the cache is exact"


def test_a_made_request_id_never_takes_a_callers(models):
    eng = engine(models["tiny-llama"])
    mine = eng.add_request([1, 2, 3], 1, request_id="req-0")
    made = eng.add_request([1, 2, 3], 1)
    assert mine == "req-0" and made != "req-0"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step_check": 3}, "step_check must be None or a callable, got 3"),
        ({"kv_events": "tcp://x"}, "kv_events must be None or a KVEventPublisher, got 'tcp://x'"),
    ],
)
def test_hooks_that_are_not_hooks_are_refused(models, kwargs, match):
    with pytest.raises(EngineError, match=match):
        engine(models["tiny-llama"], **kwargs)


def test_the_default_plan_keeps_a_hybrids_states_in_the_kv_pages_and_a_tensor_parallel_ones_in_a_pool():
    specs = get_model_config("tiny-qwen3-next").layer_specs()
    assert Engine.build("tiny-qwen3-next", memory_bytes=4 << 20, max_model_len=256).manager.config.shared_states
    assert default_state_layout(specs) == "shared_pages"
    assert default_state_layout(specs, tensor_parallel=2) == "state_pool"
    assert default_state_layout(get_model_config("tiny-llama").layer_specs()) == "attention_pages"


def test_an_engine_sizes_a_picked_state_pool_for_its_requests_and_a_tenth_of_memory():
    config = Engine.build(
        "tiny-qwen3-next",
        memory_bytes=4 << 20,
        max_model_len=256,
        max_num_seqs=3,
        plan=PlanOptions(state_layout="state_pool"),
    ).manager.config
    assert config.state_pool.num_live_states == 3 * len(config.state_group_ids)
    assert config.state_pool.num_checkpoint_states == int(0.1 * (4 << 20)) // config.state_pool.state_bytes


def test_a_plan_beside_a_kv_config_or_for_another_mesh_is_refused(models):
    config = Engine.build("tiny-llama", memory_bytes=2 << 20, max_model_len=256).manager.config
    with pytest.raises(EngineError, match="plan=PlanOptions"):
        Engine(models["tiny-llama"], config, plan=PlanOptions())
    with pytest.raises(EngineError, match="plan must be a PlanOptions"):
        Engine(models["tiny-llama"], memory_bytes=2 << 20, max_model_len=256, plan={"block_size": 8})
    with pytest.raises(EngineError, match="tensor_parallel=2 differs"):
        Engine(models["tiny-llama"], memory_bytes=2 << 20, max_model_len=256, plan=PlanOptions(tensor_parallel=2))


# ------------------------------------------------------------------ stopping and sampling
def test_a_sequence_stops_at_eos_frees_its_blocks_at_once_and_leaves_its_prefix_cached(models, dense_tokens):
    greedy = dense_tokens["tiny-llama"][0]
    eos = greedy[3]
    cut = greedy.index(eos)
    eng = engine(models["tiny-llama"], eos_token_ids=[eos])
    rid = eng.add_request(workload()[0], NEW_TOKENS)
    step = eng.step()
    while not step.finished:
        step = eng.step()
    [out] = step.finished
    assert out.finish_reason == "stop" and list(out.output_token_ids) == greedy[: cut + 1]
    assert not eng.has_unfinished and not eng.manager.has_request(rid)
    assert eng.audit().device_blocks_leaked == 0
    again = eng.generate([workload()[0]], SamplingParams(temperature=0, ignore_eos=True, max_tokens=NEW_TOKENS))
    assert again.outputs[0].finish_reason == "length" and tokens(again) == [greedy]
    assert again.num_cached_prompt_tokens == 32, "the stopped request's prompt blocks stayed cached"


def test_min_tokens_keeps_eos_and_stop_ids_from_being_drawn(models, dense_tokens):
    greedy = dense_tokens["tiny-llama"][0]
    eng = engine(models["tiny-llama"], eos_token_ids=[greedy[0]])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=3, stop_token_ids=[greedy[1]])
    [out] = eng.generate([workload()[0]], params).outputs
    assert greedy[0] not in out.output_token_ids[:3] and greedy[1] not in out.output_token_ids[:3]
    assert len(out.output_token_ids) >= 3


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(models):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=NEW_TOKENS)
    alone = engine(models["tiny-llama"]).generate([workload()[0]], params).outputs[0]
    w = workload()  # w[3] is w[0] again
    crowd = engine(models["tiny-llama"]).generate(
        [w[1], w[0], w[2], w[3]],
        [SamplingParams(temperature=1.5, max_tokens=5), params, SamplingParams(top_k=3), params],
    )
    assert crowd.outputs[1].output_token_ids == crowd.outputs[3].output_token_ids == alone.output_token_ids
    unseeded = engine(models["tiny-llama"]).generate([workload()[0]] * 2, SamplingParams(max_tokens=NEW_TOKENS))
    assert unseeded.outputs[0].output_token_ids != unseeded.outputs[1].output_token_ids


def test_the_n_sequences_of_a_request_share_the_prompts_blocks(models):
    eng = engine(models["tiny-llama"])
    prompt = workload()[1]  # 78 tokens: 4 full blocks
    rid = eng.add_request(prompt, SamplingParams(n=3, seed=1, max_tokens=8))
    tables = {}
    outputs = []
    while eng.has_unfinished:
        outputs += eng.step().finished
        for i in range(3):
            if eng.manager.has_request(f"{rid}#{i}"):
                tables[i] = eng.manager.get_block_ids(f"{rid}#{i}")[0]
    assert sorted(o.index for o in outputs) == [0, 1, 2] and {o.request_id for o in outputs} == {rid}
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert sum(o.num_cached_tokens for o in outputs) == 2 * 64
    assert len({o.output_token_ids for o in outputs}) > 1, "seeds seed, seed + 1, seed + 2 differ"
    assert eng.audit().device_blocks_leaked == 0


def test_logprobs_come_with_each_token_most_likely_first(models, dense_tokens):
    eng = engine(models["tiny-llama"])
    [out] = eng.generate([workload()[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3)).outputs
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, lp in zip(out.output_token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3 and lp.top[0] == (token, lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_sampling_params_that_need_what_the_engine_lacks_are_refused(models):
    eng = engine(models["tiny-llama"], eos_token_ids=list(range(40)))
    with pytest.raises(EngineError, match="stop strings \\('x',\\) need a tokenizer"):
        eng.add_request([1, 2], SamplingParams(stop="x"))
    with pytest.raises(EngineError, match="stop token 600 is not an id"):
        eng.add_request([1, 2], SamplingParams(stop_token_ids=[600]))
    with pytest.raises(EngineError, match="masks at most 32 stop ids, got 40"):
        eng.add_request([1, 2], SamplingParams(min_tokens=1))
    assert not eng.has_unfinished


def test_bad_branch_points_are_refused_before_anything_is_queued(models):
    eng = engine(models["tiny-llama"])
    with pytest.raises(EngineError, match=r"branch point 3 is not a position in \(0, 3\)"):
        eng.add_request([1, 2, 3], 2, branch_points=[3])
    assert not eng.has_unfinished
    eng.add_request([1, 2, 3], 2, branch_points=[2])
    assert eng.has_unfinished
