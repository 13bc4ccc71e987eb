"""PromptDigests: digests taken from a recent prompt are exactly what hashing would give."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core.hashing import NO_EXTRA_KEYS, BlockHasher, ExtraKeys, int32_le_bytes
from jaxkv.core.prompt_digests import PromptDigests

BS = 4
BLOCK_BYTES = 4 * BS


def packed(ids: list[int]) -> bytes:
    return int32_le_bytes(array("I", ids))


def hashed(hasher: BlockHasher, memo: PromptDigests, ids: list[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> list[bytes]:
    """What the manager does on a prompt's first hashing: take, hash the rest, remember."""
    prompt = packed(ids)
    digests = memo.shared(prompt, extra)
    hasher.extend_bytes(digests, prompt, extra)
    memo.remember(prompt, extra, digests)
    return digests


def fresh(hasher: BlockHasher, ids: list[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> list[bytes]:
    out: list[bytes] = []
    hasher.extend(out, ids, extra)
    return out


def test_a_prompt_sharing_a_system_prompt_takes_the_shared_blocks_digests():
    hasher, memo = BlockHasher(BS), PromptDigests(BLOCK_BYTES)
    system = list(range(100, 110))  # 2 full blocks and 2 more tokens
    first = hashed(hasher, memo, [*system, 7, 8, 9, 10, 11])
    second = [*system, 20, 21, 22, 23, 24, 25]
    assert memo.shared(packed(second), NO_EXTRA_KEYS) == first[:2]  # block 2 differs in its last 2 tokens
    assert hashed(hasher, memo, second) == fresh(hasher, second)


def test_a_prompt_is_found_only_by_its_first_block_and_only_with_the_same_extra_keys():
    hasher, memo = BlockHasher(BS), PromptDigests(BLOCK_BYTES)
    prompt = list(range(12))
    hashed(hasher, memo, prompt)
    assert memo.shared(packed([99, *prompt[1:]]), NO_EXTRA_KEYS) == []
    salted = ExtraKeys(cache_salt="tenant")
    assert memo.shared(packed(prompt), salted) == []
    assert hashed(hasher, memo, prompt, salted) == fresh(hasher, prompt, salted)
    assert memo.shared(packed(prompt), ExtraKeys(cache_salt="tenant")) == fresh(hasher, prompt, salted)


def test_a_prompt_shorter_than_a_block_is_not_remembered():
    memo = PromptDigests(BLOCK_BYTES)
    memo.remember(packed([1, 2, 3]), NO_EXTRA_KEYS, [])
    assert len(memo) == 0


def test_only_the_prompts_own_digests_are_kept_not_the_requests_list():
    hasher, memo = BlockHasher(BS), PromptDigests(BLOCK_BYTES)
    prompt, decoded = list(range(8)), list(range(8, 16))
    digests = fresh(hasher, prompt + decoded)  # the prompt's 2 blocks, then 2 decoded ones
    memo.remember(packed(prompt), NO_EXTRA_KEYS, digests)
    expected = digests[:2]
    digests[:] = [b"x" * 32] * 4  # the request's list is its own business afterwards
    assert memo.shared(packed(prompt + decoded), NO_EXTRA_KEYS) == expected


def test_the_oldest_prompts_go_once_the_budget_is_spent():
    hasher, memo = BlockHasher(BS), PromptDigests(BLOCK_BYTES, budget_bytes=3 * 8 * 4)
    for k in range(4):
        hashed(hasher, memo, [1000 * k + i for i in range(8)])  # 32 bytes each
    assert len(memo) == 3
    assert memo.shared(packed(list(range(8))), NO_EXTRA_KEYS) == []
    assert memo.shared(packed([3000 + i for i in range(8)]), NO_EXTRA_KEYS) != []


@settings(max_examples=150, deadline=None)
@given(
    stream=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 30), st.lists(st.integers(0, 9), max_size=14), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_digests_through_the_memo_equal_hashing_from_scratch(stream):
    """Prompts cut from a few shared prefixes at any length, with or without a salt."""
    prefixes = [list(range(50 * k, 50 * k + 30)) for k in range(3)]
    hasher, memo = BlockHasher(BS), PromptDigests(BLOCK_BYTES, budget_bytes=400)
    for prefix, cut, suffix, salted in stream:
        ids = prefixes[prefix][:cut] + suffix
        extra = ExtraKeys(cache_salt="s") if salted else NO_EXTRA_KEYS
        assert hashed(hasher, memo, ids, extra) == fresh(hasher, ids, extra)
