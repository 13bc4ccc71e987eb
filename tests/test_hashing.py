"""Tests of jaxkv.core.hashing: chained block hashes, extra keys, serialization, errors."""

from __future__ import annotations

import hashlib
import pickle
import re
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core.hashing import (
    HASH_ALGORITHMS,
    NO_EXTRA_KEYS,
    ROOT_DOMAIN,
    BlockHasher,
    ExtraKeys,
    InvalidBlockError,
    InvalidBlockSizeError,
    InvalidExtraKeysError,
    InvalidTokenIdError,
    MissingHashSeedError,
    MultiModalItem,
    UnknownHashAlgorithmError,
    digest_size,
    root_hash,
)

ALGOS = pytest.mark.parametrize("algo", HASH_ALGORITHMS)
DIGEST = {"sha256": lambda m: hashlib.sha256(m).digest(), "xxh3_128": xxhash.xxh3_128_digest}


def hashes_of(hasher: BlockHasher, tokens, extra: ExtraKeys = NO_EXTRA_KEYS) -> list[bytes]:
    out: list[bytes] = []
    hasher.extend(out, tokens, extra)
    return out


# --- an independent, slow re-implementation of the documented format ------------------


def ref_field(tag: bytes, data: bytes) -> bytes:
    return tag + struct.pack("<I", len(data)) + data


def ref_mm(item: MultiModalItem) -> bytes:
    if isinstance(item.hash, str):
        tag, data = b"m", item.hash.encode()
    else:
        tag, data = b"M", item.hash
    return tag + struct.pack("<QQI", item.offset, item.length, len(data)) + data


def ref_hashes(algo: str, block_size: int, tokens, extra: ExtraKeys) -> list[bytes]:
    digest = DIGEST[algo]
    parent = digest(ROOT_DOMAIN + b"\0" + algo.encode() + b"\0" + struct.pack("<Q", block_size))
    out = []
    for b in range(len(tokens) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        msg = parent + b"".join(struct.pack("<i", int(t)) for t in tokens[lo:hi])
        if b == 0 and extra.cache_salt is not None:
            msg += ref_field(b"S", extra.cache_salt.encode())
        if extra.lora_name is not None:
            msg += ref_field(b"L", extra.lora_name.encode())
        for item in sorted(extra.mm_items, key=lambda i: i.offset):
            if item.offset < hi and item.offset + item.length > lo:
                msg += ref_mm(item)
        parent = digest(msg)
        out.append(parent)
    return out


def parse_message(msg: bytes, digest_len: int, block_size: int):
    """Parse a block message back into (parent, tokens, fields); raises if malformed."""
    parent = msg[:digest_len]
    tokens = list(struct.unpack(f"<{block_size}i", msg[digest_len : digest_len + 4 * block_size]))
    pos, fields = digest_len + 4 * block_size, []
    while pos < len(msg):
        tag = msg[pos : pos + 1]
        pos += 1
        if tag in (b"S", b"L"):
            (n,) = struct.unpack_from("<I", msg, pos)
            pos += 4
            fields.append((tag, msg[pos : pos + n]))
        elif tag in (b"M", b"m"):
            off, length, n = struct.unpack_from("<QQI", msg, pos)
            pos += 20
            fields.append((tag, off, length, msg[pos : pos + n]))
        else:
            raise AssertionError(f"bad tag {tag!r}")
        pos += n
    assert pos == len(msg)
    return parent, tokens, fields


# --- strategies -----------------------------------------------------------------------

token_ids = st.integers(0, 2**31 - 1)
small_tokens = st.integers(0, 300)
names = st.none() | st.text(max_size=6)


@st.composite
def mm_items(draw) -> tuple[MultiModalItem, ...]:
    items, pos = [], draw(st.integers(0, 10))
    for _ in range(draw(st.integers(0, 4))):
        length = draw(st.integers(1, 20))
        h = draw(st.text(min_size=1, max_size=4) | st.binary(min_size=1, max_size=4))
        items.append(MultiModalItem(h, pos, length))
        pos += length + draw(st.integers(0, 15))
    return tuple(draw(st.permutations(items)))


extras = st.builds(ExtraKeys, cache_salt=names, lora_name=names, mm_items=mm_items())


# --- stability ------------------------------------------------------------------------


def test_algorithms_and_digest_sizes():
    assert HASH_ALGORITHMS == ("sha256", "xxh3_128")
    assert digest_size("sha256") == 32 and digest_size("xxh3_128") == 16
    for algo in HASH_ALGORITHMS:
        h = BlockHasher(16, algo)
        assert (h.block_size, h.algo, h.digest_size) == (16, algo, digest_size(algo))
        assert h.block_bytes == len(h.serialize_block(None, list(range(16)), 0)) - h.digest_size == 64
        assert h.root == root_hash(algo, 16) and len(h.root) == h.digest_size
        assert all(type(x) is bytes and len(x) == h.digest_size for x in hashes_of(h, range(40)))


def test_golden_values_are_stable():
    # Pinned: these must never change (hashes are shared across processes and hosts).
    assert root_hash("sha256", 16).hex() == ("af62a322dda0bfd7cf012c4a093d1ea2db38dea3896bdc53697dd66f05c1de3e")
    assert root_hash("xxh3_128", 16).hex() == "3af6e0309306f01abc2701332c2ba9b2"
    extra = ExtraKeys("tenant", "adapter", (MultiModalItem("img", 3, 4),))
    got = {algo: [h.hex() for h in hashes_of(BlockHasher(4, algo), list(range(10)), extra)] for algo in HASH_ALGORITHMS}
    assert got == GOLDEN


GOLDEN = {
    "sha256": [
        "d969a059aa92bba689af1345945a72c7f57015b39dd398fc8492b67c93d4e98c",
        "210f54ceae1767d2db1125dfeb243127e4560c30ce36eaba61f1459ab6126a25",
    ],
    "xxh3_128": [
        "6618cf93cb8a744d61dd9cb95602cbb2",
        "eb843938d8e52ee36f8099763b0f78c7",
    ],
}


@ALGOS
def test_fresh_instances_agree(algo):
    tokens = list(range(100, 164))
    assert hashes_of(BlockHasher(16, algo), tokens) == hashes_of(BlockHasher(16, algo), tokens)


def test_roots_differ_by_algorithm_and_block_size():
    roots = {root_hash(a, b) for a in HASH_ALGORITHMS for b in (1, 2, 16, 32)}
    assert len(roots) == 8


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGORITHMS),
    block_size=st.integers(1, 8),
    tokens=st.lists(token_ids, max_size=60),
    extra=extras,
)
def test_matches_reference_implementation(algo, block_size, tokens, extra):
    hasher = BlockHasher(block_size, algo)
    assert hashes_of(hasher, tokens, extra) == ref_hashes(algo, block_size, tokens, extra)


# --- chaining and laziness ------------------------------------------------------------


@ALGOS
def test_chaining_changes_every_later_hash(algo):
    hasher = BlockHasher(4, algo)
    tokens = list(range(20))
    base = hashes_of(hasher, tokens)
    changed = hashes_of(hasher, [99, *tokens[1:]])
    assert all(a != b for a, b in zip(base, changed, strict=True))
    # A change in block 2 keeps blocks 0-1.
    later = hashes_of(hasher, [*tokens[:9], 99, *tokens[10:]])
    assert later[:2] == base[:2] and all(a != b for a, b in zip(base[2:], later[2:], strict=True))


@ALGOS
def test_partial_blocks_are_not_hashed(algo):
    hasher = BlockHasher(4, algo)
    hashes: list[bytes] = []
    assert hasher.extend(hashes, [1, 2, 3]) == 0 and hashes == []
    assert hasher.extend(hashes, list(range(10))) == 2 and len(hashes) == 2
    assert hasher.extend(hashes, list(range(11))) == 0 and len(hashes) == 2
    assert hasher.extend(hashes, list(range(12))) == 1 and len(hashes) == 3
    assert hasher.extend(hashes, list(range(4))) == 0 and len(hashes) == 3


@ALGOS
def test_hash_block_chains_like_extend(algo):
    hasher = BlockHasher(4, algo)
    tokens = list(range(7, 23))
    extra = ExtraKeys("s", "l", (MultiModalItem(b"x", 5, 6),))
    parent, chained = None, []
    for b in range(4):
        block = tokens[4 * b : 4 * b + 4]
        parent = hasher.hash_block(parent, block, b, extra)
        message = hasher.serialize_block(chained[-1] if chained else None, block, b, extra)
        assert parent == DIGEST[algo](message)
        chained.append(parent)
    assert chained == hashes_of(hasher, tokens, extra)


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGORITHMS),
    block_size=st.integers(1, 8),
    tokens=st.lists(small_tokens, max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    extra=extras,
    as_numpy=st.booleans(),
)
def test_incremental_equals_one_shot(algo, block_size, tokens, cuts, extra, as_numpy):
    hasher = BlockHasher(block_size, algo)
    incremental: list[bytes] = []
    for cut in [*sorted(cuts), len(tokens)]:
        prefix = tokens[:cut]
        before = len(incremental)
        stream = np.asarray(prefix, np.int64) if as_numpy else prefix
        added = hasher.extend(incremental, stream, extra)
        assert added == len(incremental) - before
        assert len(incremental) == max(before, len(prefix) // block_size)
    assert incremental == hashes_of(hasher, tokens, extra)


@ALGOS
def test_decode_one_token_at_a_time(algo):
    hasher = BlockHasher(16, algo)
    extra = ExtraKeys(cache_salt="t", lora_name="a", mm_items=(MultiModalItem("i", 20, 40),))
    stream, hashes = [], []
    for t in range(200):
        stream.append(t)
        hasher.extend(hashes, stream, extra)
    assert hashes == hashes_of(hasher, stream, extra) and len(hashes) == 12


@given(
    algo=st.sampled_from([*HASH_ALGORITHMS, "sha256_cbor"]),
    block_size=st.integers(1, 8),
    tokens=st.lists(small_tokens, max_size=80),
    cut=st.integers(0, 80),
    salt=st.sampled_from([None, "", "s"]),
)
def test_packed_ids_hash_like_the_list_and_the_list_goes_on_from_them(algo, block_size, tokens, cut, salt):
    hasher = BlockHasher(block_size, algo, seed="k")
    extra = ExtraKeys(cache_salt=salt)
    hashes: list[bytes] = []
    packed = np.asarray(tokens[:cut], "<i4").tobytes()
    assert hasher.extend_bytes(hashes, packed, extra) == min(cut, len(tokens)) // block_size
    assert hasher.extend_bytes(hashes, packed, extra) == 0
    hasher.extend(hashes, tokens, extra)
    assert hashes == hashes_of(hasher, tokens, extra)


def test_packed_ids_are_checked_and_a_refusal_changes_nothing():
    hasher = BlockHasher(4)
    hashes = hashes_of(hasher, list(range(8)))
    before = list(hashes)
    packed = struct.pack("<12I", *range(10), 2**31, 11)
    with pytest.raises(InvalidTokenIdError, match=r"2147483648 at position 10 ") as info:
        hasher.extend_bytes(hashes, packed)
    assert info.value.position == 10
    for bad in (packed[:-1], bytearray(packed), list(range(12))):
        with pytest.raises(InvalidTokenIdError, match="4 per id"):
            hasher.extend_bytes(hashes, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidExtraKeysError):
        hasher.extend_bytes(hashes, struct.pack("<12I", *range(12)), "salt")  # type: ignore[arg-type]
    assert hashes == before
    big = struct.pack("<5000I", *range(4999), 2**32 - 1)
    with pytest.raises(InvalidTokenIdError, match="4294967295 at position 4999 "):
        hasher.extend_bytes([], big)


# --- extra keys -----------------------------------------------------------------------


@ALGOS
def test_salt_changes_first_block_and_all_later(algo):
    hasher = BlockHasher(4, algo)
    tokens = list(range(16))
    variants = [hashes_of(hasher, tokens, ExtraKeys(cache_salt=s)) for s in (None, "", "a", "b")]
    for i, a in enumerate(variants):
        for b in variants[i + 1 :]:
            assert all(x != y for x, y in zip(a, b, strict=True))
    # The salt is serialized in block 0 only; later blocks differ by chaining alone.
    h = variants[2]
    salted = ExtraKeys(cache_salt="a")
    assert b"a" in hasher.serialize_block(None, tokens[:4], 0, salted)[-5:]
    later = hasher.serialize_block(h[0], tokens[4:8], 1, salted)
    assert later == h[0] + struct.pack("<4i", *tokens[4:8])


@ALGOS
def test_lora_changes_every_block(algo):
    hasher = BlockHasher(4, algo)
    tokens = list(range(16))
    plain = hashes_of(hasher, tokens)
    for extra in (ExtraKeys(lora_name="x"), ExtraKeys(lora_name=""), ExtraKeys(lora_name="y")):
        h = hashes_of(hasher, tokens, extra)
        assert all(a != b for a, b in zip(plain, h, strict=True))
        for b in range(1, 4):
            assert hasher.serialize_block(h[b - 1], tokens[4 * b : 4 * b + 4], b, extra).endswith(
                b"L" + struct.pack("<I", len(extra.lora_name)) + extra.lora_name.encode()
            )
    assert hashes_of(hasher, tokens, ExtraKeys(lora_name="x")) != hashes_of(hasher, tokens, ExtraKeys(lora_name="y"))


@ALGOS
def test_mm_item_changes_exactly_the_blocks_it_overlaps(algo):
    hasher = BlockHasher(4, algo)
    tokens = [7] * 32  # placeholder tokens everywhere: only the extras can tell
    plain = hashes_of(hasher, tokens)
    item = MultiModalItem("image-1", 10, 7)  # tokens 10..16 -> blocks 2, 3, 4
    extra = ExtraKeys(mm_items=(item,))
    h = hashes_of(hasher, tokens, extra)
    assert h[:2] == plain[:2]
    assert all(a != b for a, b in zip(plain[2:], h[2:], strict=True))
    for b in range(8):
        msg = hasher.serialize_block(h[b - 1] if b else None, tokens[4 * b : 4 * b + 4], b, extra)
        assert (b"image-1" in msg) == (2 <= b <= 4)
    # Another item, or the same item at another offset or length, gives other hashes.
    for other in (MultiModalItem("image-2", 10, 7), MultiModalItem("image-1", 11, 6), MultiModalItem("image-1", 10, 6)):
        h2 = hashes_of(hasher, tokens, ExtraKeys(mm_items=(other,)))
        assert h2[:2] == plain[:2] and h2[4] != h[4]


def test_mm_items_in_offset_order_within_a_block():
    hasher = BlockHasher(8, "sha256")
    a, b = MultiModalItem(b"A", 1, 2), MultiModalItem("B", 4, 9)
    e1, e2 = ExtraKeys(mm_items=[b, a]), ExtraKeys(mm_items=(a, b))
    assert e1 == e2 and hash(e1) == hash(e2) and e1.mm_items == (a, b)
    tokens = list(range(24))
    assert hashes_of(hasher, tokens, e1) == hashes_of(hasher, tokens, e2)
    msg = hasher.serialize_block(None, tokens[:8], 0, e1)
    assert msg.index(b"A") < msg.index(b"B")


def test_extra_keys_equality_and_hashing():
    e = ExtraKeys("s", "l", [MultiModalItem("h", np.int64(3), 2)])
    assert e == ExtraKeys("s", "l", (MultiModalItem("h", 3, 2),))
    assert type(e.mm_items[0].offset) is int
    assert len({e, ExtraKeys("s", "l", (MultiModalItem("h", 3, 2),)), ExtraKeys()}) == 2
    assert ExtraKeys() == NO_EXTRA_KEYS
    restored = pickle.loads(pickle.dumps(e))
    hasher = BlockHasher(2, "sha256")
    assert restored == e
    assert hashes_of(hasher, range(12), restored) == hashes_of(hasher, range(12), e)


@ALGOS
def test_list_numpy_tuple_inputs_agree(algo):
    hasher = BlockHasher(16, algo)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**31, size=1000)
    extra = ExtraKeys(lora_name="l")
    want = hashes_of(hasher, arr.tolist(), extra)
    assert len(want) == 62
    for tokens in (
        arr,
        arr.astype(np.int32),
        arr.astype(np.uint32),
        tuple(arr.tolist()),
        [np.int64(t) for t in arr[:100]] + arr[100:].tolist(),
    ):
        assert hashes_of(hasher, tokens, extra) == want
    small = rng.integers(0, 200, size=64)
    assert hashes_of(hasher, small.astype(np.uint8)) == hashes_of(hasher, small.tolist())


# --- unambiguous serialization --------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 6),
    tokens=st.lists(token_ids, min_size=6, max_size=6),
    extra=extras,
    block_index=st.integers(0, 3),
)
def test_messages_parse_back_to_their_inputs(block_size, tokens, extra, block_index):
    hasher = BlockHasher(block_size, "xxh3_128")
    block = tokens[:block_size]
    parent = None if block_index == 0 else b"p" * 16
    msg = hasher.serialize_block(parent, block, block_index, extra)
    got_parent, got_tokens, fields = parse_message(msg, 16, block_size)
    assert got_parent == (parent or hasher.root) and got_tokens == block
    want = []
    if block_index == 0 and extra.cache_salt is not None:
        want.append((b"S", extra.cache_salt.encode()))
    if extra.lora_name is not None:
        want.append((b"L", extra.lora_name.encode()))
    lo, hi = block_index * block_size, (block_index + 1) * block_size
    for item in extra.mm_items:
        if item.offset < hi and item.offset + item.length > lo:
            is_str = isinstance(item.hash, str)
            data = item.hash.encode() if is_str else item.hash
            want.append((b"m" if is_str else b"M", item.offset, item.length, data))
    assert fields == want


@ALGOS
def test_classic_confusions_are_impossible(algo):
    h1 = BlockHasher(1, algo)
    h2 = BlockHasher(2, algo)
    # [1, 2] vs [258]-style confusions: ids are fixed-width int32, and the root commits
    # to the block size.
    assert h2.serialize_block(None, [1, 2], 0)[-8:] == struct.pack("<2i", 1, 2)
    assert hashes_of(h2, [1, 2]) != hashes_of(h2, [258, 0])
    assert not set(hashes_of(h2, [1, 2, 1, 2])) & set(hashes_of(h1, [1, 2, 258, 1, 2]))
    assert hashes_of(h2, [1, 2]) != hashes_of(h2, [2, 1])
    tokens = [5, 6, 7, 8]
    distinct = [
        ExtraKeys(),
        ExtraKeys(cache_salt="ab", lora_name="c"),
        ExtraKeys(cache_salt="a", lora_name="bc"),
        ExtraKeys(cache_salt="abc"),
        ExtraKeys(lora_name="abc"),
        ExtraKeys(cache_salt=""),
        ExtraKeys(lora_name=""),
        ExtraKeys(mm_items=(MultiModalItem("abc", 0, 1),)),
        ExtraKeys(mm_items=(MultiModalItem(b"abc", 0, 1),)),
        ExtraKeys(mm_items=(MultiModalItem("ab", 0, 1), MultiModalItem("c", 1, 1))),
        ExtraKeys(mm_items=(MultiModalItem("a", 0, 1), MultiModalItem("bc", 1, 1))),
        ExtraKeys(mm_items=(MultiModalItem("a", 0, 2), MultiModalItem("bc", 2, 1))),
    ]
    first_blocks = [hashes_of(h2, tokens, e)[0] for e in distinct]
    assert len(set(first_blocks)) == len(distinct)


# --- errors ---------------------------------------------------------------------------


def test_unknown_algorithm():
    with pytest.raises(UnknownHashAlgorithmError, match=r"'md5'.*sha256, xxh3_128"):
        BlockHasher(16, "md5")
    assert issubclass(UnknownHashAlgorithmError, ValueError)
    with pytest.raises(UnknownHashAlgorithmError):
        root_hash("SHA256", 16)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True, "16", None])
def test_bad_block_size(block_size):
    with pytest.raises(InvalidBlockSizeError, match=re.escape(repr(block_size))):
        BlockHasher(block_size)


@ALGOS
@pytest.mark.parametrize(
    "bad, shown",
    [(-1, "-1"), (2**31, "2147483648"), (2**70, str(2**70)), (1.5, "1.5"), ("3", "'3'"), (None, "None")],
)
def test_bad_token_ids_leave_hashes_unchanged(algo, bad, shown):
    hasher = BlockHasher(4, algo)
    hashes = hashes_of(hasher, list(range(8)))
    before = list(hashes)
    tokens = [*range(8), 1, 2, bad, 4, *range(100)]  # error at position 10
    with pytest.raises(InvalidTokenIdError, match=shown) as info:
        hasher.extend(hashes, tokens)
    assert info.value.position == 10 and hashes == before
    assert isinstance(info.value, ValueError)
    # Past the error, nothing changed: the good prefix still extends correctly.
    assert hasher.extend(hashes, list(range(12))) == 1


@ALGOS
def test_bad_numpy_token_ids(algo):
    hasher = BlockHasher(4, algo)
    hashes: list[bytes] = []
    with pytest.raises(InvalidTokenIdError, match="2147483648") as info:
        hasher.extend(hashes, np.array([1, 2, 3, 4, 5, 2**31, 7, 8], dtype=np.int64))
    assert info.value.token_id == 2**31 and info.value.position == 5
    with pytest.raises(InvalidTokenIdError, match="-3"):
        hasher.extend(hashes, np.array([1, 2, 3, -3], dtype=np.int32))
    with pytest.raises(InvalidTokenIdError, match="float64"):
        hasher.extend(hashes, np.arange(8, dtype=np.float64))
    with pytest.raises(InvalidTokenIdError, match="bool"):
        hasher.extend(hashes, np.ones(8, dtype=bool))
    with pytest.raises(InvalidTokenIdError, match=r"\(8, 2\)"):
        hasher.extend(hashes, np.zeros((8, 2), dtype=np.int32))
    assert hashes == []


@pytest.mark.parametrize("bad", [-7, 2**31, 2**32 - 1, 2**32])
@pytest.mark.parametrize("size", [64, 5000])
def test_bad_token_found_in_small_and_large_lists(bad, size):
    hasher = BlockHasher(16, "xxh3_128")
    tokens = list(range(size))
    tokens[size - 30] = bad
    with pytest.raises(InvalidTokenIdError, match=f"{bad} at position {size - 30} "):
        hasher.extend([], tokens)


@pytest.mark.parametrize(
    "make, shown",
    [
        (lambda: MultiModalItem("h", -1, 4), "-1"),
        (lambda: MultiModalItem("h", 0, 0), "0"),
        (lambda: MultiModalItem("h", 0, -2), "-2"),
        (lambda: MultiModalItem("h", 1.0, 2), "1.0"),
        (lambda: MultiModalItem("h", 0, True), "True"),
        (lambda: MultiModalItem("", 0, 1), "''"),
        (lambda: MultiModalItem(42, 0, 1), "42"),
        (lambda: ExtraKeys(cache_salt=5), "5"),
        (lambda: ExtraKeys(lora_name=b"x"), "b'x'"),
        (lambda: ExtraKeys(cache_salt="\ud800"), "ud800"),
        (lambda: ExtraKeys(mm_items=("h", 0, 1)), "'h'"),
        (lambda: ExtraKeys(mm_items=MultiModalItem("h", 0, 1)), "MultiModalItem"),
        (lambda: ExtraKeys(mm_items=(MultiModalItem("a", 0, 5), MultiModalItem("b", 4, 1))), "overlap"),
    ],
)
def test_malformed_extras(make, shown):
    with pytest.raises(InvalidExtraKeysError, match=re.escape(shown)):
        make()


@ALGOS
def test_bad_extra_and_chain_leave_hashes_unchanged(algo):
    hasher = BlockHasher(4, algo)
    hashes = hashes_of(hasher, list(range(8)))
    before = list(hashes)
    with pytest.raises(InvalidExtraKeysError, match="'salt'"):
        hasher.extend(hashes, list(range(12)), "salt")  # type: ignore[arg-type]
    with pytest.raises(InvalidBlockError, match="digest"):
        hasher.extend([*hashes[:1], b"short"], list(range(12)))
    foreign = hashes_of(BlockHasher(4, "xxh3_128" if algo == "sha256" else "sha256"), range(8))
    with pytest.raises(InvalidBlockError):
        hasher.extend(foreign, list(range(12)))
    assert hashes == before


@ALGOS
def test_hash_block_errors(algo):
    hasher = BlockHasher(4, algo)
    root_child = hasher.hash_block(None, [1, 2, 3, 4], 0)
    with pytest.raises(InvalidBlockError, match="got 3"):
        hasher.hash_block(None, [1, 2, 3], 0)
    with pytest.raises(InvalidBlockError, match="block_index is 2"):
        hasher.hash_block(None, [1, 2, 3, 4], 2)
    with pytest.raises(InvalidBlockError, match="must be None"):
        hasher.hash_block(root_child, [1, 2, 3, 4], 0)
    with pytest.raises(InvalidBlockError, match="-1"):
        hasher.hash_block(root_child, [1, 2, 3, 4], -1)
    with pytest.raises(InvalidBlockError, match="b'xy'"):
        hasher.hash_block(b"xy", [1, 2, 3, 4], 1)
    with pytest.raises(InvalidTokenIdError, match="-5"):
        hasher.hash_block(root_child, [1, 2, -5, 4], 1)
    with pytest.raises(InvalidExtraKeysError):
        hasher.hash_block(None, [1, 2, 3, 4], 0, None)  # type: ignore[arg-type]


# --- a per-deployment seed ---------------------------------------------------------------
def test_a_seed_changes_every_hash_and_the_same_seed_agrees_everywhere(monkeypatch):
    tokens = list(range(32))
    monkeypatch.delenv("JAXKV_HASH_SEED", raising=False)
    public = hashes_of(BlockHasher(16), tokens)
    seeded = hashes_of(BlockHasher(16, seed="deployment-secret"), tokens)
    assert not set(public) & set(seeded) and BlockHasher(16).root == root_hash("sha256", 16)
    monkeypatch.setenv("JAXKV_HASH_SEED", "deployment-secret")
    assert hashes_of(BlockHasher(16), tokens) == seeded, "the environment's seed is the same seed"
    assert hashes_of(BlockHasher(16, seed="other"), tokens) != seeded
    assert BlockHasher(16, "xxh3_128").root != root_hash("xxh3_128", 16)


# --- vLLM's sha256_cbor --------------------------------------------------------------------
def test_sha256_cbor_matches_a_hand_encoded_vector():
    """vLLM: NONE_HASH = sha256(cbor(PYTHONHASHSEED)); a block's hash is
    sha256(cbor((parent, tuple(token_ids), extra_keys))), canonical CBOR. The bytes below
    are written out by hand from RFC 8949 (text "0" = 0x61 0x30; a 32-byte string =
    0x58 0x20 + bytes; an array of n < 24 = 0x80 + n; 1000 = 0x19 0x03e8; null = 0xf6)."""
    root = hashlib.sha256(b"\x61\x30").digest()
    assert root_hash("sha256_cbor", 4, "0") == root
    first = hashlib.sha256(b"\x83\x58\x20" + root + b"\x84\x01\x02\x03\x19\x03\xe8" + b"\xf6").digest()
    salted = hashlib.sha256(b"\x83\x58\x20" + root + b"\x84\x01\x02\x03\x19\x03\xe8" + b"\x81\x64salt").digest()
    second = hashlib.sha256(b"\x83\x58\x20" + first + b"\x84\x05\x06\x07\x08" + b"\xf6").digest()
    hasher = BlockHasher(4, "sha256_cbor", seed="0")
    assert hashes_of(hasher, [1, 2, 3, 1000, 5, 6, 7, 8]) == [first, second]
    assert hashes_of(hasher, [1, 2, 3, 1000], ExtraKeys(cache_salt="salt")) == [salted]
    assert hashes_of(hasher, [1, 2, 3, 1000], ExtraKeys(cache_salt="")) == [first], "vLLM skips an empty salt"
    assert hasher.hash_block(None, [1, 2, 3, 1000], 0) == first
    assert hasher.serialize_block(first, [5, 6, 7, 8], 1) == b"\x83\x58\x20" + first + b"\x84\x05\x06\x07\x08\xf6"


def test_sha256_cbor_needs_a_seed_and_takes_no_multimodal_items(monkeypatch):
    monkeypatch.delenv("JAXKV_HASH_SEED", raising=False)
    with pytest.raises(MissingHashSeedError, match="sha256_cbor needs a hash seed"):
        BlockHasher(16, "sha256_cbor")
    hasher = BlockHasher(4, "sha256_cbor", seed="s")
    with pytest.raises(InvalidExtraKeysError, match="no multimodal items"):
        hasher.extend([], [1, 2, 3, 4], ExtraKeys(mm_items=(MultiModalItem(b"img", 0, 4),)))
