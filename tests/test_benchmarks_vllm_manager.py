"""vLLM's own manager behind jaxkv's scheduler: refused plans, and, where vLLM is installed
(the benchmark extra), replays that match jaxkv's where the two decide alike."""

import pytest
from kv_configs import FULL, make_config, window

from jaxkv.benchmarks.vllm_manager import PeerError, VllmManager, vllm_available
from jaxkv.core.manager import KVCacheManager
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.simulator import Simulator, synthetic_trace

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM (the benchmark extra) is not installed")


def chat_trace(conversations: int = 12):
    return synthetic_trace(
        num_conversations=conversations,
        turns_per_conversation=3,
        num_system_prompts=3,
        system_prompt_len=96,
        user_turn_len=(8, 40),
        output_len=(4, 24),
        arrival_rate=4.0,
        turn_gap_s=0.5,
        seed=3,
    )


def test_a_plan_in_jaxkvs_own_layouts_is_refused_before_vllm_is_needed():
    shared = plan_kv_cache(get_preset("tiny-mamba-hybrid"), 30 << 20, max_model_len=8192)
    with pytest.raises(PeerError, match="state_layout='attention_pages'"):
        VllmManager(shared, 8192, 2048)


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_without_vllm_the_error_names_the_extra():
    with pytest.raises(PeerError, match=r"vLLM is not importable.*benchmark extra"):
        VllmManager(make_config(8, FULL), 256, 64)


@needs_vllm
@pytest.mark.parametrize("specs", [(FULL,), (window(32), FULL)], ids=["full", "window+full"])
def test_a_replay_through_vllm_decides_as_jaxkv_where_both_follow_vllms_rules(specs):
    config = make_config(40, *specs)
    trace = chat_trace()
    ours = Simulator(KVCacheManager(config, max_model_len=512), max_num_seqs=8, max_num_batched_tokens=128).run(trace)
    peer = VllmManager(config, 512, 128)
    theirs = Simulator(peer, max_num_seqs=8, max_num_batched_tokens=128).run(trace)
    assert ours.num_preemptions > 0 and ours.num_prompt_hit_tokens > 0  # the trace presses on the pool
    assert (theirs.num_steps, theirs.num_preemptions) == (ours.num_steps, ours.num_preemptions)
    assert theirs.num_prompt_hit_tokens == ours.num_prompt_hit_tokens
    assert theirs.outputs == ours.outputs and peer.usage == 0.0


@needs_vllm
@pytest.mark.parametrize("budget", [2048, 300])
def test_a_recurrent_replay_in_vllms_layout_decides_as_vllm_where_memory_is_not_short(budget):
    # (under pressure the two part: vLLM's align mode holds up to 2 state blocks a request, jaxkv 1)
    vllm_rule = PlanOptions(state_layout="attention_pages")
    config = plan_kv_cache(get_preset("tiny-mamba-hybrid"), 8 << 20, max_model_len=8192, options=vllm_rule)
    trace = chat_trace(40)
    ours = Simulator(KVCacheManager(config), max_num_seqs=8, max_num_batched_tokens=budget).run(trace)
    peer = VllmManager(config, 8192, budget)
    theirs = Simulator(peer, max_num_seqs=8, max_num_batched_tokens=budget).run(trace)
    assert ours.num_prompt_hit_tokens > 0 and ours.num_prompt_hit_tokens % config.hash_block_size == 0
    assert (theirs.num_steps, theirs.num_prompt_hit_tokens) == (ours.num_steps, ours.num_prompt_hit_tokens)
    assert theirs.outputs == ours.outputs and peer.usage == 0.0
