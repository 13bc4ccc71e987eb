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


def test_branch_ahead_places_states_back_from_the_end_within_a_budget_while_prompts_branch():
    config = dataclasses.replace(WITH_STATES, states=StatePool(num_states=17))  # 16 states: 4 branch-ahead
    ahead = CheckpointPolicy(config, None, enable_caching=True)
    assert ahead.branch_budget == 4
    assert ahead.ahead(5000, 0, 0, 0, 0) == (2944, 3968, 4736), "2048, 1024, 256 back, on block boundaries"
    assert ahead.positions(5000, 0, 0, (2944, 3968)) == (2944, 3968, 4992)
    assert ahead.shared(5000, 0, 0, (2944, 3968)) == {2944, 3968}
    assert ahead.ahead(5000, 0, 0, 0, 1) == (3968, 4736), "two running: half the budget each, most likely first"
    assert ahead.ahead(5000, 0, 0, 0, 3) == (3968, 4736), "a prompt that starts a chain: still two"
    assert ahead.ahead(5000, 0, 0, 0, 40) == (3968, 4736), "at memory's floor the guesses a second request hits"
    assert ahead.ahead(1024, 0, 0, 0, 0) == (896,), "no longer than the first depth, starts a chain: 128 back"
    assert ahead.ahead(1024, 0, 512, 512, 0) == (), "no longer than the first depth, branches: none"
    assert ahead.unwarmed(1024, (896,)) == (896,), "a short prompt's guess: only hits ending on it keep it warm"
    assert ahead.unwarmed(5000, (3968, 4736)) == (), "a long prompt's: as warm as their prefix"
    assert ahead.ahead(5000, 0, 3000, 3000, 0) == (3968, 4736), "a branch past its hit: only past its reach"
    assert ahead.ahead(5000, 0, 3000, 3000, 3) == (3968,), "a branch: its share of the budget"
    assert ahead.ahead(5000, 0, 3000, 3000, 40) == (3968,), "a branch with the budget spent: still the most likely"
    assert ahead.ahead(5000, 3000, 3000, 3000, 0) == (), "extends a cached chain at its end (a chat turn)"
    ahead.observe(True)
    ahead.observe(None)
    assert ahead.ahead(5000, 0, 0, 0, 0) == (2944, 3968, 4736)
    for _ in range(2):
        ahead.observe(False)  # most admissions extend chains: no guesses
    assert ahead.ahead(5000, 0, 0, 0, 0) == ()
    off = CheckpointPolicy(config, None, enable_caching=True, branch_ahead=False)
    assert off.ahead(5000, 0, 0, 0, 0) == ()
    assert policy(config=make_config(64, FULL)).ahead(5000, 0, 0, 0, 0) == (), "no state groups"


def test_branch_points_place_states_at_block_boundaries_past_the_hit():
    assert policy().branch_positions((40, 100, 130), 32) == (96, 128), "40 rounds down to the hit, not past it"
    assert policy(enable_caching=False).branch_positions((100,), 0) == ()
    assert policy(config=make_config(64, FULL)).branch_positions((100,), 0) == (), "no state groups"


def test_continuations_stay_warm_unless_recent_admissions_branch_and_none_extends_a_chain():
    p = policy()
    assert p.continuations_resumed(), "nothing observed yet: keep them warm"
    for _ in range(7):
        p.observe(True, False)
    assert p.continuations_resumed(), "fewer than 8 admissions matched a chain"
    p.observe(None, None)  # matched nothing: not an observation
    assert p.continuations_resumed()
    p.observe(True, False)
    assert not p.continuations_resumed(), "8 branched off chains, none extended one"
    p.observe(False, True)
    assert not p.continuations_resumed(), "1 of 9 extended a chain: below an eighth"
    p.observe(False, True)
    assert p.continuations_resumed(), "2 of 10 extended a chain at its end: turns resume"
