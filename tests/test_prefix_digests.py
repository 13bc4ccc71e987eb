"""A prompt that starts with a prefix a lookup hit takes its hashes instead of hashing it
again, and they are exactly the hashes hashing would give."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_configs import FULL, admit, make_manager

from jaxkv.hashing import NO_EXTRA_KEYS, BlockHasher, ExtraKeys
from jaxkv.manager import Request
from jaxkv.prefix_digests import PrefixDigests

STEP = 64  # bytes of a 16-token block


def packed(tokens: list[int]) -> bytes:
    return np.asarray(tokens, "<i4").tobytes()


def hashes_of(tokens: list[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> list[bytes]:
    out: list[bytes] = []
    BlockHasher(16).extend(out, tokens, extra)
    return out


def test_a_prompt_takes_the_longest_recorded_prefix_it_starts_with():
    system, turn = list(range(100, 164)), list(range(500, 532))
    memo = PrefixDigests(STEP)
    memo.record(packed(system), NO_EXTRA_KEYS, hashes_of(system))
    memo.record(packed(system + turn), NO_EXTRA_KEYS, hashes_of(system + turn))
    assert memo.take(packed(system + turn + [7] * 40), NO_EXTRA_KEYS) == tuple(hashes_of(system + turn))
    assert memo.take(packed(system + [9] * 40), NO_EXTRA_KEYS) == tuple(hashes_of(system))
    assert memo.take(packed(system[:48] + [9] * 40), NO_EXTRA_KEYS) == ()  # shares 3 of its 4 blocks
    assert memo.take(packed(system + turn), ExtraKeys(cache_salt="tenant")) == ()


def test_only_whole_prompt_blocks_are_recorded_and_a_prefix_once():
    memo = PrefixDigests(STEP)
    prompt = list(range(100, 140))  # 2 whole blocks and 8 tokens
    memo.record(packed(prompt), NO_EXTRA_KEYS, hashes_of(prompt + [1] * 8))  # 3 hashes: one past the prompt
    memo.record(packed(prompt), NO_EXTRA_KEYS, hashes_of(prompt))
    assert len(memo) == 1 and memo.take(packed(prompt), NO_EXTRA_KEYS) == tuple(hashes_of(prompt))


def test_memory_is_bounded_oldest_prefix_out_first():
    size = STEP + 32  # one block's bytes and its hash
    memo = PrefixDigests(STEP, max_bytes=3 * size, per_head=2)
    prompts = [[i] * 16 for i in range(10, 14)]
    for p in prompts:
        memo.record(packed(p), NO_EXTRA_KEYS, hashes_of(p))
    assert len(memo) == 3 and memo.take(packed(prompts[0]), NO_EXTRA_KEYS) == ()
    head = list(range(200, 216))
    for extra_blocks in range(3):  # three prefixes behind one first block: the oldest goes
        p = head + [300 + extra_blocks] * 16 * extra_blocks
        memo.record(packed(p), NO_EXTRA_KEYS, hashes_of(p))
    assert memo.take(packed(head + [5] * 16), NO_EXTRA_KEYS) == ()
    assert memo.take(packed(head + [302] * 32), NO_EXTRA_KEYS) == tuple(hashes_of(head + [302] * 32))


@settings(max_examples=30, deadline=None)
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 40), st.sampled_from([None, "a", "b"])), min_size=1, max_size=12
    )
)
def test_served_prompts_hash_exactly_as_hashing_them_afresh(picks):
    """Requests over shared prefixes (whole and part blocks), with and without a cache
    salt, admitted one after another so later lookups hit earlier prompts."""
    mgr = make_manager(400, FULL)
    shared = [list(range(1000 * k, 1000 * k + n)) for k, n in ((1, 64), (2, 70), (3, 37))]
    for i, (which, suffix, salt) in enumerate(picks):
        tokens = shared[which] + [7 + i] * suffix
        req = Request(f"r{i}", tokens, cache_salt=salt)
        admit(mgr, req)
        assert req.block_hashes == hashes_of(tokens, req.extra_keys)


def test_a_second_request_with_a_system_prompt_hashes_only_its_own_blocks(monkeypatch):
    import hashlib

    mgr = make_manager(100, FULL)
    system = list(range(100, 164))  # 4 blocks
    admit(mgr, Request("a", system + [5] * 20))
    admit(mgr, Request("b", system + [6] * 20))  # hits the system prompt: it is recorded
    digests = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data=b"": digests.append(data) or real(data))
    req = Request("c", system + [7] * 40)
    admit(mgr, req)
    assert len(digests) == 2 and req.block_hashes == hashes_of(system + [7] * 40)
