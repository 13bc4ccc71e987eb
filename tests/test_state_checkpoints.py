"""Where a recurrent request's prefill caches its state, and how its chunks end there."""

import dataclasses

import pytest
from kv_configs import FULL, make_config

from jaxkv.manager_errors import KVCacheManagerError
from jaxkv.planner import StatePool
from jaxkv.specs import MambaSpec
from jaxkv.state_checkpoints import CheckpointPolicy

STATE = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
WITH_STATES = dataclasses.replace(make_config(64, FULL, STATE), state_pool=StatePool(num_states=8))


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
