"""The planner's contract, checked against what the manager and scheduler really do: a
plan the Engine accepts serves one request of ``max_model_len`` tokens alone, in every
layout, and the refusal just below names that smallest budget.

The planner and the manager count a request's blocks with one function
(:func:`jaxkv.planner.held_blocks`); these tests drive the real scheduler and manager
(the simulator, then the engine on a tiny model) at the smallest budget the Engine's
planning accepts, so a count that forgets something the manager holds fails here.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_configs import smallest_accepted

from jaxkv.core.manager import KVCacheManager
from jaxkv.models.tiny import MODEL_CONFIGS, TinyLM
from jaxkv.planner import InsufficientMemoryError, KVCacheConfig, PlanOptions, held_blocks, plan_kv_cache
from jaxkv.serving.engine import Engine, plan_for_model
from jaxkv.serving.simulator import Simulator, TraceRequest
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

LAYOUTS = ("shared_pages", "state_pool", "attention_pages")


def refusal_names_the_smallest(model: object, smallest: int, *, max_model_len: int, **kwargs) -> None:
    with pytest.raises(InsufficientMemoryError) as refused:
        plan_for_model(model, smallest - 1, max_model_len=max_model_len, **kwargs)
    named = re.search(r"smallest budget that fits is ([\d,]+) B", str(refused.value))
    assert named is not None, str(refused.value)
    assert int(named.group(1).replace(",", "")) == smallest, str(refused.value)


@st.composite
def hybrid_specs(draw: st.DrawFn) -> dict[str, KVCacheSpec]:
    """Full attention, sometimes sliding windows, and recurrent layers whose state weighs
    from under one page to many."""
    kv = {"num_kv_heads": 2, "head_size": 16, "dtype": "float32"}
    specs: dict[str, KVCacheSpec] = {}
    for i in range(draw(st.integers(1, 2))):
        specs[f"full.{i}"] = FullAttentionSpec(**kv)
    window = draw(st.sampled_from([None, 16, 40]))
    for i in range(draw(st.integers(0, 2)) if window else 0):
        specs[f"window.{i}"] = SlidingWindowSpec(**kv, sliding_window=window)
    state = draw(st.sampled_from([(8, 16), (64, 64), (128, 160)]))
    for i in range(draw(st.integers(1, 3))):
        specs[f"recurrent.{i}"] = MambaSpec(shapes=(state,), dtypes=("float32",))
    return specs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=hybrid_specs(),
    layout=st.sampled_from(LAYOUTS),
    block_size=st.sampled_from([16, 32]),
    max_model_len=st.integers(24, 300),
    num_output_tokens=st.integers(1, 40),
    step_tokens=st.sampled_from([16, 64, 2048]),
)
def test_the_smallest_accepted_budget_serves_one_max_model_len_request_twice_without_preemption(
    specs, layout, block_size, max_model_len, num_output_tokens, step_tokens
):
    model = SimpleNamespace(layer_specs=lambda: specs)
    kwargs = {
        "options": PlanOptions(state_layout=layout, block_size=block_size),
        "max_num_seqs": 4,
        "max_num_batched_tokens": step_tokens,
    }
    smallest, config = smallest_accepted(model, max_model_len=max_model_len, **kwargs)
    refusal_names_the_smallest(model, smallest, max_model_len=max_model_len, **kwargs)
    num_output_tokens = min(num_output_tokens, max_model_len - 1)
    prompt = tuple(range(1, max_model_len - num_output_tokens + 1))
    # The same prompt twice (the second resumes from the first's checkpoints while they
    # last), then another whose prompt ends on a block boundary.
    trace = [
        TraceRequest("first", 0.0, prompt, num_output_tokens),
        TraceRequest("again", 1e6, prompt, num_output_tokens),
        TraceRequest("aligned", 2e6, tuple(range(7, 7 + max_model_len // 16 * 16 - 1)), 1),
    ]
    sim = Simulator(KVCacheManager(config), max_num_seqs=4, max_num_batched_tokens=step_tokens)
    result = sim.run(trace)
    assert result.num_finished == len(trace) and result.num_preemptions == 0


def test_held_blocks_count_one_live_state_per_recurrent_group_with_a_state_layout_and_two_in_vllms():
    full = FullAttentionSpec(num_kv_heads=2, head_size=16, dtype="float32")
    window = SlidingWindowSpec(num_kv_heads=2, head_size=16, dtype="float32", sliding_window=32)
    state = MambaSpec(shapes=((64, 64),), dtypes=("float32",))
    specs = {"full": full, "window": window, "state": state}
    paged = PlanOptions(state_layout="attention_pages")
    for options, per_group in ((PlanOptions(state_layout="shared_pages"), None), (paged, 2)):
        config = plan_kv_cache_at_1mib(specs, options)
        (state_group,) = [i for i, g in enumerate(config.groups) if isinstance(g.spec, MambaSpec)]
        counted = held_blocks(config.groups, None if per_group else config.shared_states.pages_per_state, 256, 64)
        assert counted == config.blocks_per_request(256)
        assert counted[state_group] == (per_group or config.shared_states.pages_per_state)


def plan_kv_cache_at_1mib(specs: dict[str, KVCacheSpec], options: PlanOptions) -> KVCacheConfig:
    return plan_kv_cache(
        specs, 1 << 20, max_model_len=256, options=dataclasses.replace(options, max_num_batched_tokens=64)
    )


TINY_RECURRENT = MODEL_CONFIGS["tiny-qwen3-next"]


@st.composite
def tiny_recurrent_models(draw: st.DrawFn) -> tuple[str, object]:
    """Tiny Qwen3-Next-like models: recurrent layers beside full attention and sometimes a
    sliding window, with states from a few pages to a fraction of one."""
    pattern = draw(st.sampled_from([(True, False), (True, True, True, False), (True, False, True, False)]))
    windows = tuple(None if r else draw(st.sampled_from([None, 24])) for r in pattern)
    if all(w is not None for w, r in zip(windows, pattern, strict=True) if not r):
        windows = (*windows[:-1], None)
    heads = draw(st.sampled_from([1, 4]))
    config = dataclasses.replace(TINY_RECURRENT, windows=windows, recurrent=pattern, delta_heads=heads)
    return f"tiny-{''.join('r' if r else 'a' for r in pattern)}-{heads}h", config


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=tiny_recurrent_models(),
    layout=st.sampled_from(LAYOUTS),
    block_size=st.sampled_from([16, 32]),
    max_model_len=st.integers(40, 112),
)
def test_an_engine_at_its_smallest_budget_serves_a_max_model_len_request_with_the_tokens_of_caching_off(
    model, layout, block_size, max_model_len
):
    name, config = model
    tiny = TinyLM(config, seed=1, name=name)
    kwargs = {"options": PlanOptions(state_layout=layout, block_size=block_size), "max_num_batched_tokens": 32}
    smallest, _ = smallest_accepted(tiny, max_model_len=max_model_len, **kwargs)
    prompt = np.random.default_rng(max_model_len).integers(1, config.vocab_size, max_model_len - 6).tolist()
    tokens = []
    for caching in (True, False):
        engine = Engine(
            tiny,
            memory_bytes=smallest,
            max_model_len=max_model_len,
            plan=kwargs["options"],
            max_num_batched_tokens=32,
            enable_caching=caching,
        )
        passes = [engine.generate([prompt], 6) for _ in range(2 if caching else 1)]
        assert all(p.num_preemptions == 0 for p in passes)
        tokens.append([list(p.outputs[0].output_token_ids) for p in passes])
        audit = engine.audit()
        assert audit.device_blocks_leaked == 0
    assert tokens[0] == tokens[1] * 2
