"""The salted-prefix memo behind the ``salt`` miss cause: the keys it offers, and its bound."""

from jaxkv.core.hashing import ExtraKeys
from jaxkv.core.salted_prefixes import SaltedPrefixes


def first_block(k: int) -> bytes:
    return bytes([k]) * 64


def test_the_unsalted_keys_first_then_the_newest_other_salt_of_the_same_first_block():
    memo = SaltedPrefixes(block_bytes=64, capacity=2)
    a, b = ExtraKeys(cache_salt="a", lora_name="l"), ExtraKeys(cache_salt="b", lora_name="l")
    assert memo.others(first_block(1), a) == [ExtraKeys(lora_name="l")]
    memo.note(first_block(1) + b"tail", b)
    memo.note(first_block(1)[:10], a)  # shorter than a block: not remembered
    assert memo.others(first_block(1), a) == [ExtraKeys(lora_name="l"), b]
    assert memo.others(first_block(1), b) == [ExtraKeys(lora_name="l")], "its own salt is no mismatch"
    memo.note(first_block(2), a)
    memo.note(first_block(3), a)
    assert len(memo) == 2 and memo.others(first_block(1), a) == [ExtraKeys(lora_name="l")], "the oldest forgotten"
