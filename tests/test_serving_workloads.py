"""Synthetic shared-prefix prompt batches."""

import pytest

from jaxkv.errors import JaxkvError
from jaxkv.serving.workloads import WorkloadError, shared_prefix_prompts


def test_prompts_share_their_prefix_round_robin_and_have_unique_tails():
    prompts = shared_prefix_prompts(num_requests=6, num_prefixes=2, prefix_len=10, suffix_len=(3, 5), vocab_size=50)
    assert len(prompts) == 6
    assert {tuple(p[:10]) for p in prompts[0::2]} == {tuple(prompts[0][:10])}
    assert prompts[0][:10] != prompts[1][:10]
    assert all(13 <= len(p) <= 15 and all(0 <= t < 50 for t in p) for p in prompts)
    assert len({tuple(p[10:]) for p in prompts}) == 6
    again = shared_prefix_prompts(num_requests=6, num_prefixes=2, prefix_len=10, suffix_len=(3, 5), vocab_size=50)
    assert again == prompts


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_requests": 0}, "num_requests must be a.* int.*, got 0"),
        ({"suffix_len": (0, 2)}, r"suffix_len must be a range \(lo, hi\) .*got \(0, 2\)"),
        ({"prefix_len": -1}, "prefix_len must be a.* int.*, got -1"),
        ({"seed": -1}, "seed must be a.* int.*, got -1"),
        ({"suffix_len": (1, 2, 3)}, r"suffix_len .*got \(1, 2, 3\)"),
        ({"suffix_len": "12"}, "suffix_len .*got '12'"),
        ({"suffix_len": 4}, "suffix_len .*got 4"),
        ({"vocab_size": 2.5}, "vocab_size must be a.* int.*, got 2.5"),
        ({"num_prefixes": True}, "num_prefixes must be a.* int.*, got True"),
    ],
)
def test_bad_knobs_are_named(change, match):
    knobs = {"num_requests": 2, "num_prefixes": 1, "prefix_len": 4, "suffix_len": (1, 2), "vocab_size": 8}
    with pytest.raises(WorkloadError, match=match) as err:
        shared_prefix_prompts(**{**knobs, **change})
    assert isinstance(err.value, JaxkvError) and isinstance(err.value, ValueError)
