"""Every model family served as a user serves it, checked against transformers: each
layout its cache can take (the three state layouts for a recurrent hybrid, vLLM's for
attention alone) x {cold then the same batch again, the smallest budget the engine
accepts (with preemption), a host tier storing by each policy}.

Every token is transformers' greedy pick (its logits within :data:`ENGINE_ATOL`); the
same batch sent again resumes each prompt at least from its last block boundary before
its last token (the resend checkpoint: 16 tokens in jaxkv's layouts, vLLM's larger
blocks in its own); no block leaks.
"""

from __future__ import annotations

import pytest
from hf_checkpoints import (
    ENGINE_ATOL,
    FAMILIES,
    host_tier,
    serve_against_transformers,
    shared_prefix_prompts,
    smallest_budget,
)

from jaxkv.core.state_checkpoints import resend_position
from jaxkv.planner import PlanError, PlanOptions

RECURRENT = ("qwen3_next", "nemotron_h")
STATE_LAYOUTS = ("shared_pages", "state_pool")
CASES = [
    (family, layout)
    for family in FAMILIES
    for layout in (("shared_pages", "state_pool", "attention_pages") if family in RECURRENT else ("attention_pages",))
]


def served(family, layout, tmp_path, memory_bytes, **kwargs):
    run = serve_against_transformers(
        family, tmp_path, memory_bytes=memory_bytes, plan=PlanOptions(state_layout=layout), **kwargs
    )
    assert run["max_abs_diff"] < ENGINE_ATOL
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_the_same_batch_sent_again_resumes_every_prompt_at_its_resend_checkpoint(family, layout, tmp_path):
    run = served(family, layout, tmp_path, 8 << 20)
    resend = [resend_position(len(p), run["hit_block_size"]) for p in shared_prefix_prompts()]
    assert all(c >= r for c, r in zip(run["cached_per_prompt"][1], resend, strict=True)), run["cached_per_prompt"]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_the_smallest_accepted_budget_serves_the_batch_twice_preempting_where_two_fit(family, layout, tmp_path):
    memory = smallest_budget(family, tmp_path / "sizing", layout)
    prompts = shared_prefix_prompts()
    run = served(family, layout, tmp_path, memory, prompts=prompts)
    config = run["kv_config"]
    # Preemption needs two requests running at once: a state of more pages than a prompt's KV may leave room for one.
    two_fit = 2 * sum(config.blocks_per_request(min(map(len, prompts)))) <= config.num_usable_blocks
    assert run["preemptions"] > 0 or not two_fit


@pytest.mark.slow
@pytest.mark.parametrize("store", ["on_eviction", "write_through"])
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_a_host_tier_brings_back_what_the_smallest_budget_evicted(family, layout, store, tmp_path):
    memory = smallest_budget(family, tmp_path / "sizing", layout)
    run = served(family, layout, tmp_path, memory, offload=host_tier(store))
    assert run["host_loaded_tokens"] > 0 and run["cached"][1] > 0
    assert (run["host_loaded_states"] > 0) == (family in RECURRENT)  # a hybrid's host hit ends on a state


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in RECURRENT])
@pytest.mark.parametrize("layout", STATE_LAYOUTS)
def test_a_state_layout_is_refused_by_name_for_attention_alone(family, layout, tmp_path):
    with pytest.raises(PlanError, match=layout):
        smallest_budget(family, tmp_path, layout)
