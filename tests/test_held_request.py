"""A held request's event thresholds: where its next allocation starts to change something."""

from kv_configs import FULL, make_config, window

from jaxkv.core.coordinator import KVCacheCoordinator
from jaxkv.core.held_request import HeldRequest
from jaxkv.core.request import Request
from jaxkv.core.single_type import NEVER


def held_in(coord: KVCacheCoordinator, num_tokens: int) -> HeldRequest:
    """A request of ``num_tokens`` tokens given slots for all of them by ``coord``."""
    request = Request("r", list(range(num_tokens)))
    coord.allocate("r", num_tokens, None, 0)
    return HeldRequest(request)


def test_a_one_token_step_is_quiet_below_the_first_threshold_it_would_cross():
    held = HeldRequest(Request("r", [1]))
    held.set_thresholds(capacity=48, next_full=64, next_skip=40)
    assert held.quiet_below == 40  # a block leaves the window at 40 computed tokens
    held.set_thresholds(capacity=48, next_full=33, next_skip=NEVER)
    assert held.quiet_below == 32  # computing token 32 makes the 33rd a block's last: it fills
    held.set_thresholds(capacity=48, next_full=NEVER, next_skip=NEVER)
    assert held.quiet_below == 48


def test_the_thresholds_are_the_coordinators_capped_at_max_model_len_and_never_full_without_caching():
    coord = KVCacheCoordinator(make_config(20, FULL, window(32)))
    held = held_in(coord, 40)  # 3 blocks a group: slots for 48 tokens
    capacity, next_full, next_skip = coord.thresholds("r")
    assert capacity == 48
    held.read_thresholds(coord, max_model_len=44, caching=True)
    assert (held.capacity, held.next_full, held.next_skip) == (44, next_full, next_skip)
    held.read_thresholds(coord, max_model_len=8192, caching=False)
    assert (held.capacity, held.next_full, held.next_skip) == (48, NEVER, next_skip)


def test_an_update_reads_only_the_thresholds_of_the_events_that_happened():
    coord = KVCacheCoordinator(make_config(20, FULL, window(32)))
    held = held_in(coord, 40)
    held.set_thresholds(1, 2, 3)
    held.update_thresholds(coord, 8192, grew=True, filled=False, skipped=False)
    assert (held.capacity, held.next_full, held.next_skip) == (48, 2, 3)
    held.update_thresholds(coord, 8192, grew=False, filled=True, skipped=True)
    assert (held.capacity, held.next_full, held.next_skip) == (48, coord.next_full("r"), coord.next_skip("r"))
    assert held.quiet_below == min(48, coord.next_full("r") - 1, coord.next_skip("r"))
