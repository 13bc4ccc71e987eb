"""Synthetic shared-prefix prompt batches."""

import pytest

from jaxkv.errors import JaxkvError
from jaxkv.serving.workloads import WorkloadError, conversations, shared_prefix_prompts


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


def test_a_chat_trace_has_tenants_system_prompts_and_follow_ups_that_extend_the_last_turn():
    chats = conversations(
        num_conversations=20, num_tenants=8, system_len=12, num_turns=3, message_len=(2, 4), vocab_size=50, seed=3
    )
    assert len(chats) == 20 and all(c.num_turns == 3 for c in chats)
    by_tenant = {}
    for c in chats:
        by_tenant.setdefault(c.tenant, set()).add(c.system_prompt)
    assert all(len(prompts) == 1 for prompts in by_tenant.values()) and len(by_tenant) > 1
    assert len({c.system_prompt for c in chats}) == len(by_tenant)
    chat = chats[0]
    first = chat.prompt(0)
    assert first[:12] == list(chat.system_prompt) and 14 <= len(first) <= 16
    follow_up = chat.prompt(1, first, [7, 8])
    assert follow_up == [*first, 7, 8, *list(chat.user_messages[1])]


def test_bad_chat_trace_knobs_are_refused():
    with pytest.raises(WorkloadError, match=r"message_len must be a range \(lo, hi\) .*got \(3, 2\)"):
        conversations(num_conversations=1, num_tenants=1, system_len=1, num_turns=1, message_len=(3, 2), vocab_size=5)
    with pytest.raises(WorkloadError, match=r"num_turns must be a.* int.*, got 0"):
        conversations(num_conversations=1, num_tenants=1, system_len=1, num_turns=0, message_len=(1, 2), vocab_size=5)
