"""Where a recurrent request's prefill caches its state, and how its chunks end there
(checkpoints of the state groups; vLLM's align mode in its layout)."""

import dataclasses

import pytest
from kv_configs import FULL, make_config

from jaxkv.core.manager_errors import KVCacheManagerError
from jaxkv.core.state_checkpoints import AlignedChunks, CheckpointPolicy
from jaxkv.planner import StatePool
from jaxkv.specs import MambaSpec

STATE = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
WITH_STATES = dataclasses.replace(make_config(64, FULL, STATE), states=StatePool(num_states=8))


def policy(interval=None, enable_caching=True, config=WITH_STATES):
    return CheckpointPolicy(config, interval, enable_caching=enable_caching)


def test_the_prompt_end_and_where_attention_ran_ahead_are_checkpoints():
    assert policy().positions(100, 0, 0) == (96,), "the last block boundary of a 100-token prompt"
    assert policy().positions(100, 50, 0) == (48, 96), "full attention alone matched 50 tokens"
    assert policy().shared(100, 50, 0) == {48}, "the prompt's end is the request's own, not shared"
    assert policy().positions(100, 50, 48) == (96,) and policy().positions(100, 50, 96) == ()


def test_checkpoint_interval_adds_positions_and_cuts_prefill_chunks():
    assert policy(32).positions(100, 0, 0) == (32, 64, 96)
    assert policy(32).chunk_limit(100, 0, 40, 60) == 24, "from 40, the next checkpoint is 64"
    assert policy(32).chunk_limit(100, 0, 40, 20) == 20, "none inside the chunk"


@pytest.mark.parametrize("interval", [20, 0, -32, 32.0, True])
def test_an_interval_off_the_hash_blocks_is_refused(interval):
    with pytest.raises(KVCacheManagerError, match=f"checkpoint_interval must be .* 16, got {interval!r}"):
        policy(interval)


def test_no_state_groups_or_no_caching_no_checkpoints():
    no_states = policy(config=make_config(64, FULL))
    assert no_states.positions(100, 50, 0) == () and no_states.chunk_limit(100, 50, 0, 100) == 100
    assert policy(enable_caching=False).positions(100, 50, 0) == ()


def test_a_one_token_step_is_never_cut():
    assert policy().chunk_limit(100, 0, 95, 1) == 1 and policy().chunk_limit(100, 0, 95, 2) == 1


VLLM_LAYOUT = make_config(64, FULL, STATE)  # a state per attention page, blocks of 16


def aligned(max_num_batched_tokens=2048):
    return AlignedChunks(dataclasses.replace(VLLM_LAYOUT, max_num_batched_tokens=max_num_batched_tokens))


def test_vllms_layout_ends_a_prefill_chunk_on_a_block_boundary_or_not_at_all():
    # a 100-token prompt from 0, 60 tokens of budget: 48 (the boundary below 60)
    assert aligned().chunk_limit(100, 100, 0, 0, 60) == 48
    assert aligned().chunk_limit(100, 100, 48, 48, 10) == 0, "no boundary within 10 tokens of 48: wait a step"
    assert aligned(8).chunk_limit(100, 100, 48, 48, 8) == 8, "a block wider than any chunk: run sub-block"
    assert aligned().chunk_limit(100, 100, 48, 48, 52) == 48, "the last boundary before the last token: 96"
    assert aligned().chunk_limit(100, 100, 96, 96, 4) == 4, "the prompt's tail runs to its end"


def test_vllms_layout_stops_a_chunk_at_the_next_boundary_and_at_the_junction():
    assert aligned().chunk_limit(100, 100, 40, 40, 60) == 8, "a chunk starting mid-block ends at its boundary"
    assert aligned().chunk_limit(100, 100, 70, 16, 84) == 48, "attention alone matched 70: stop at 64"
    assert aligned().chunk_limit(100, 100, 16, 16, 84) == 80, "no junction: the last boundary, 96"


def test_vllms_layout_cuts_a_resumed_request_up_to_its_last_output_and_never_decodes():
    # preempted after 30 outputs: 130 tokens to recompute, the prefill ends at 129
    assert aligned().chunk_limit(100, 130, 0, 0, 129) == 128
    assert aligned().chunk_limit(100, 130, 129, 129, 1) == 1
    assert aligned().chunk_limit(100, 101, 100, 100, 1) == 1, "a decode step is never cut"


def test_only_recurrent_groups_in_vllms_layout_cut_chunks():
    assert aligned().block_size == 16
    assert AlignedChunks(make_config(64, FULL)).block_size == 0, "attention alone"
    assert AlignedChunks(WITH_STATES).block_size == 0, "a state pool: CheckpointPolicy's positions"


def test_branch_ahead_learns_where_prompts_diverge_and_whether_they_branch():
    ahead = CheckpointPolicy(WITH_STATES, None, enable_caching=True, branch_ahead=True)
    assert ahead.ahead(1000, 0, 0, 0) == 736, "before any divergence: 256 tokens back from the end"
    assert ahead.positions(1000, 0, 0, 736) == (736, 992) and ahead.shared(1000, 0, 0, 736) == {736}
    ahead.observe(1000, 900, True)  # a prompt left a cached chain 100 tokens before its end
    assert ahead.ahead(500, 0, 0, 0) == 400
    assert ahead.ahead(500, 0, 448, 448) == 0, "found its branch: it checkpoints reach instead"
    assert ahead.ahead(500, 320, 320, 320) == 0, "extends a cached chain at its end (a chat turn)"
    assert ahead.ahead(500, 0, 320, 448) == 400, "a branch past its hit"
    for _ in range(2):
        ahead.observe(1000, 900, False)  # most admissions extend chains: no guesses
    assert ahead.ahead(500, 0, 0, 0) == 0
    assert policy().ahead(1000, 0, 0, 0) == 0, "off by default"
