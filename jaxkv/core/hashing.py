"""Chained block hashes for prefix caching.

A request's tokens are cut into blocks of ``block_size`` tokens and every FULL block
gets a hash that identifies the whole prefix up to and including it::

    hash_i = H(parent_i || tokens_i || extras_i)
    parent_0 = root_hash(algo, block_size),  parent_i = hash_{i-1}

Serialization (all integers little-endian, so hashes are stable across processes,
hosts and runs -- host offload and multi-host rely on that):

* ``parent``: the previous digest, fixed width (``digest_size`` bytes).
* ``tokens``: ``block_size`` ids as int32 (``4 * block_size`` bytes, fixed width).
* ``extras``: a sequence of tagged, length-prefixed fields, in this order:

  - ``b"S" u32(n) salt_utf8``      cache salt, first block only;
  - ``b"L" u32(n) lora_utf8``      LoRA / adapter name, every block;
  - ``b"M" u64(offset) u64(length) u32(n) hash`` (``b"m"`` when the item hash is a
    ``str``, encoded as UTF-8) for each multimodal item whose placeholder range
    ``[offset, offset + length)`` overlaps the block, in offset order.

  It is empty when a block has no extra keys, so the no-extras message is just
  ``parent || tokens``.

Within one hasher the parent and token fields are fixed width and every extras field
is tagged and length-prefixed, so a message parses back to exactly one
(parent, tokens, extras): distinct inputs never serialize to the same bytes. The root
commits to the format version, the algorithm and the block size, so chains of hashers
with different block sizes never meet either. Multimodal keys include the item's
placeholder range, not only its content hash: with identical placeholder tokens, the
same items laid out differently inside a block would otherwise share a hash.

Algorithms: ``"sha256"`` (collision resistant: the safe default when tenants do not
trust each other) and ``"xxh3_128"`` (128-bit, non-cryptographic; per block about 3x
cheaper to digest, so 2x faster end to end on list input, 3x on numpy input; see
scripts/bench_hashing.py), both over the serialization above; and ``"sha256_cbor"``,
vLLM's block hash, so that a router hashing prompts as vLLM does (llm-d's precise
prefix routing) matches jaxkv's events: ``sha256(cbor((parent, tokens, extras)))``
with canonical CBOR, ``tokens`` the block's ids as an array, ``extras`` None or the
array ``[lora_name?, cache_salt?]`` (the salt in block 0 only, and only when not
empty), the root ``sha256(cbor(seed))``, equal to vLLM's under
``PYTHONHASHSEED=seed``. It takes no multimodal items (their keys are vLLM's own).

Hash seed (a secret per deployment): with a fixed public root, anyone can search for
colliding prompts offline (cheap for ``xxh3_128``, a non-cryptographic hash) and plant
them. ``seed`` (or the environment variable ``JAXKV_HASH_SEED``) goes into the root:
``... || b"K" u32(n) seed_utf8`` for sha256 and xxh3_128, the CBOR root above for
sha256_cbor, which needs one. Every replica, router and process of one deployment
must use the same seed (set it in their environment) so that their hashes, events
and routing agree; without one, the root is the documented constant.

Token ids are validated in bulk (ints in [0, 2**31)); bad input raises a subclass of
BlockHashError (a ValueError) naming the bad value, and leaves the caller's hash list
unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import os
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import SupportsIndex

import numpy as np
import xxhash

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int

__all__ = [
    "HASH_ALGORITHMS",
    "NO_EXTRA_KEYS",
    "VLLM_HASH_ALGORITHM",
    "BlockHashError",
    "BlockHasher",
    "ExtraKeys",
    "InvalidBlockError",
    "InvalidBlockSizeError",
    "InvalidExtraKeysError",
    "InvalidTokenIdError",
    "MissingHashSeedError",
    "MultiModalItem",
    "UnknownHashAlgorithmError",
    "cbor",
    "digest_size",
    "resolve_seed",
    "root_hash",
]

_BIG_ENDIAN = sys.byteorder == "big"  # arrays hold native-order ids; hashes read little-endian

HASH_ALGORITHMS: tuple[str, ...] = ("sha256", "xxh3_128")
"""The algorithms over jaxkv's own serialization."""
VLLM_HASH_ALGORITHM = "sha256_cbor"
"""vLLM's block hash (see the module docstring), accepted wherever an algorithm is named."""
ENV_HASH_SEED = "JAXKV_HASH_SEED"
"""The environment variable holding a deployment's hash seed."""

ROOT_DOMAIN = b"jaxkv.block_hash.v1"
"""Domain tag of root hashes; bump it when the serialization changes."""

MAX_TOKEN_ID = 2**31 - 1

_DIGEST_SIZES = {"sha256": 32, "xxh3_128": 16, "sha256_cbor": 32}
_xxh3 = xxhash.xxh3_128_digest
_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128": _xxh3,
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
}
_TAG_SEED = b"K"
_TAG_SALT = b"S"
_TAG_LORA = b"L"
_TAG_MM_BYTES = b"M"
_TAG_MM_STR = b"m"
_U32 = struct.Struct("<I")
_MM_HEADER = struct.Struct("<QQI")
_MAX_U32 = 2**32 - 1
_MAX_I64 = 2**63 - 1
_ASCII_SIGN_CHECK_MAX = 4096  # up to this many ids, a bytes scan beats a numpy reduction


class BlockHashError(JaxkvError, ValueError):
    """Base class of the errors raised for bad hashing input."""


class UnknownHashAlgorithmError(BlockHashError):
    """The algorithm name is not one of HASH_ALGORITHMS."""


class InvalidBlockSizeError(BlockHashError):
    """block_size is not a positive int."""


class InvalidTokenIdError(BlockHashError):
    """A token id is not an int in [0, 2**31), or token_ids is not a 1-D int sequence."""

    def __init__(self, message: str, token_id: object = None, position: int | None = None):
        super().__init__(message)
        self.token_id = token_id
        self.position = position


class InvalidExtraKeysError(BlockHashError):
    """A cache salt, LoRA name or multimodal item is malformed."""


class InvalidBlockError(BlockHashError):
    """A parent hash, block index or block length does not fit this hasher."""


class MissingHashSeedError(BlockHashError):
    """``sha256_cbor`` was asked for without a seed (its root is the seed's hash)."""


def resolve_seed(seed: str | None) -> str | None:
    """``seed``, or when None the environment's ``JAXKV_HASH_SEED`` (None if unset or empty)."""
    if seed is None:
        seed = os.environ.get(ENV_HASH_SEED) or None
    if seed is not None and not isinstance(seed, str):
        raise InvalidExtraKeysError(f"seed must be a str or None, got {type(seed).__name__}")
    return seed


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes((major << 5 | info,)) + n.to_bytes(width, "big")
    raise InvalidBlockError(f"{n} does not fit a CBOR head")


def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949, shortest heads) of None, ints, bytes, str and
    tuples / lists of them: what vLLM's ``sha256_cbor`` digests."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise InvalidBlockError("bool is not a CBOR value here")
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return _cbor_head(0, v) if v >= 0 else _cbor_head(1, -1 - v)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise InvalidBlockError(f"{type(value).__name__} is not a CBOR value here")


def _check_algo(algo: object) -> str:
    if algo not in _DIGEST_SIZES:
        raise UnknownHashAlgorithmError(f"unknown hash algorithm {algo!r}; valid ones: {', '.join(_DIGEST_SIZES)}")
    return algo


def digest_size(algo: str) -> int:
    """Bytes in one block hash of `algo` (32 for sha256, 16 for xxh3_128)."""
    return _DIGEST_SIZES[_check_algo(algo)]


def _check_block_size(block_size: object) -> int:
    return check_int("block_size", block_size, minimum=1, error=InvalidBlockSizeError)


def root_hash(algo: str, block_size: int, seed: str | None = None) -> bytes:
    """The parent of block 0: H(ROOT_DOMAIN || 0 || algo || 0 || u64le(block_size)),
    followed by ``b"K" u32(n) seed`` with a seed; for sha256_cbor, sha256(cbor(seed)).

    Identical in every process given the same seed; ``seed`` is taken as given (see
    :func:`resolve_seed` for the environment's).
    """
    algo = _check_algo(algo)
    block_size = _check_block_size(block_size)
    if algo == "sha256_cbor":
        if seed is None:
            raise MissingHashSeedError(
                f"sha256_cbor needs a hash seed (seed= or {ENV_HASH_SEED}; vLLM's PYTHONHASHSEED)"
            )
        return hashlib.sha256(cbor(seed)).digest()
    message = ROOT_DOMAIN + b"\x00" + algo.encode("ascii") + b"\x00" + struct.pack("<Q", block_size)
    if seed is not None:
        data = _utf8(seed, "seed")
        message += _TAG_SEED + _U32.pack(len(data)) + data
    return _DIGESTS[algo](message)


def _utf8(value: str, what: str) -> bytes:
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidExtraKeysError(f"{what} {value!r} is not encodable as UTF-8: {e}") from None
    if len(data) > _MAX_U32:
        raise InvalidExtraKeysError(f"{what} is {len(data)} bytes long; the limit is {_MAX_U32}")
    return data


def _index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidExtraKeysError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidExtraKeysError(f"{what} must be an int, got {value!r}") from None


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal input: its content hash and its placeholder token range."""

    hash: str | bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.hash, (str, bytes)) or not self.hash:
            raise InvalidExtraKeysError(f"multimodal item hash must be a non-empty str or bytes, got {self.hash!r}")
        offset = _index(self.offset, "multimodal item offset")
        length = _index(self.length, "multimodal item length")
        if not 0 <= offset <= _MAX_I64:
            raise InvalidExtraKeysError(f"multimodal item offset must be >= 0, got {offset}")
        if not 0 < length <= _MAX_I64 - offset:
            raise InvalidExtraKeysError(f"multimodal item length must be > 0, got {length}")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "length", length)

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.offset + self.length

    def key(self) -> bytes:
        """The item's serialized extras field."""
        if isinstance(self.hash, str):
            tag, data = _TAG_MM_STR, _utf8(self.hash, "multimodal item hash")
        else:
            tag, data = _TAG_MM_BYTES, self.hash
            if len(data) > _MAX_U32:
                raise InvalidExtraKeysError(f"multimodal item hash is {len(data)} bytes long")
        return tag + _MM_HEADER.pack(self.offset, self.length, len(data)) + data


@dataclass(frozen=True)
class ExtraKeys:
    """Keys besides the tokens that decide whether two blocks may share KV.

    cache_salt goes into the first block only (every later hash chains from it);
    lora_name into every block; a multimodal item into the blocks its placeholder range
    overlaps. mm_items is normalized to a tuple sorted by offset; ranges must not overlap.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()

    def __post_init__(self) -> None:
        for name in ("cache_salt", "lora_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidExtraKeysError(f"{name} must be a str or None, got {value!r}")
        if isinstance(self.mm_items, (str, bytes)) or not isinstance(self.mm_items, Iterable):
            raise InvalidExtraKeysError(f"mm_items must be an iterable of MultiModalItem, got {self.mm_items!r}")
        items = tuple(self.mm_items)
        for item in items:
            if not isinstance(item, MultiModalItem):
                raise InvalidExtraKeysError(f"mm_items must hold MultiModalItem, got {item!r}")
        items = tuple(sorted(items, key=lambda item: item.offset))
        for prev, cur in itertools.pairwise(items):
            if cur.offset < prev.end:
                raise InvalidExtraKeysError(f"multimodal items overlap: {prev!r} and {cur!r}")
        salt_key = b""
        if self.cache_salt is not None:
            data = _utf8(self.cache_salt, "cache_salt")
            salt_key = _TAG_SALT + _U32.pack(len(data)) + data
        lora_key = b""
        if self.lora_name is not None:
            data = _utf8(self.lora_name, "lora_name")
            lora_key = _TAG_LORA + _U32.pack(len(data)) + data
        object.__setattr__(self, "mm_items", items)
        object.__setattr__(self, "_salt_key", salt_key)
        object.__setattr__(self, "_lora_key", lora_key)
        object.__setattr__(self, "_mm_keys", tuple(item.key() for item in items))
        object.__setattr__(self, "_mm_ends", tuple(item.end for item in items))
        object.__setattr__(self, "_empty", not (salt_key or lora_key or items))

    def block_extras(self, block_size: int, first: int, count: int) -> list[bytes]:
        """Serialized extras field of each block in [first, first + count)."""
        lora_key: bytes = self._lora_key  # type: ignore[attr-defined]
        salt_key: bytes = self._salt_key  # type: ignore[attr-defined]
        extras = [lora_key] * count
        if first == 0 and salt_key:
            extras[0] = salt_key + lora_key
        items = self.mm_items
        if not items:
            return extras
        keys: tuple[bytes, ...] = self._mm_keys  # type: ignore[attr-defined]
        lo, hi = first * block_size, (first + count) * block_size
        i = bisect.bisect_right(self._mm_ends, lo)  # type: ignore[attr-defined]
        while i < len(items) and items[i].offset < hi:
            item = items[i]
            start = max(item.offset, lo) // block_size - first
            stop = min((item.end - 1) // block_size - first + 1, count)
            for b in range(start, stop):
                extras[b] += keys[i]
            i += 1
        return extras


NO_EXTRA_KEYS = ExtraKeys()


def _bad_token(values: Iterable[object], base: int) -> InvalidTokenIdError:
    """Locate the first invalid id (the slow path, only taken once input is known bad)."""
    for pos, value in enumerate(values, base):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return InvalidTokenIdError(f"token id {value!r} at position {pos} is not an int", value, pos)
        if not 0 <= int(value) <= MAX_TOKEN_ID:
            return InvalidTokenIdError(
                f"token id {int(value)} at position {pos} is outside [0, 2**31)", int(value), pos
            )
    return InvalidTokenIdError(f"token ids from position {base} are invalid", None, base)


def int32_le_bytes(ids: array[int]) -> bytes:
    """A 4-byte integer array's ids as little-endian bytes, as the hash serializes them
    (an array holds them in native order)."""
    if _BIG_ENDIAN:
        ids = array(ids.typecode, ids)
        ids.byteswap()
    return ids.tobytes()


def _token_bytes(token_ids: Sequence[int], lo: int, hi: int, packer: struct.Struct) -> bytes:
    """token_ids[lo:hi] as little-endian int32 bytes, validated in bulk.

    A 4-byte integer array (a request keeps its ids in one) is copied as it is. Lists
    are packed with struct as uint32 (faster than array or numpy for Python ints, and
    strict: non-ints, negative ids and ids >= 2**32 fail); `packer` is the precompiled
    format when hi - lo matches it. Ids in [2**31, 2**32) (or negative in a signed
    array) are then found by their top bits, the high bit of every 4th byte.
    """
    if type(token_ids) is array and token_ids.itemsize == 4 and token_ids.typecode in "iIl":
        data = int32_le_bytes(token_ids[lo:hi])
        if _top_bit_set(data, 0, len(data)):
            raise _bad_token(token_ids[lo:hi].tolist(), lo)
        return data
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidTokenIdError(
                f"token_ids must be a 1-D integer array, got shape {token_ids.shape} dtype {token_ids.dtype}"
            )
        ids = token_ids[lo:hi]
        if ids.min() < 0 or ids.max() > MAX_TOKEN_ID:
            raise _bad_token(ids.tolist(), lo)
        return ids.astype("<i4", copy=False).tobytes()
    return _pack_list(token_ids[lo:hi], lo, packer)


def _pack_list(chunk: Sequence[int], lo: int, packer: struct.Struct) -> bytes:
    """The list branch of _token_bytes: `chunk` holds the ids from position lo on."""
    n = len(chunk)
    try:
        data = packer.pack(*chunk) if packer.size == 4 * n else struct.pack(f"<{n}I", *chunk)
    except struct.error:
        raise _bad_token(chunk, lo) from None
    if _top_bit_set(data, 0, len(data)):
        raise _bad_token(chunk, lo)
    return data


def _top_bit_set(data: bytes, lo: int, hi: int) -> bool:
    """Whether an id in ``data[lo:hi]`` (little-endian 32-bit) is >= 2**31: the high bit of
    every 4th byte, so int32 and uint32 bytes agree."""
    if hi - lo <= 4 * _ASCII_SIGN_CHECK_MAX:
        return not data[lo + 3 : hi : 4].isascii()
    return bool(np.frombuffer(data, dtype="<i4", count=(hi - lo) // 4, offset=lo).min() < 0)


class BlockHasher:
    """Hashes the full blocks of token streams for one (block_size, algorithm).

    Stateless between calls: the chain lives in the caller's hash list, so one hasher
    serves every request.
    """

    __slots__ = ("_algo", "_block_size", "_cbor", "_digest_size", "_is_sha256", "_packer", "_root", "_step")

    def __init__(self, block_size: int, algo: str = "sha256", *, seed: str | None = None):
        """``seed``: the deployment's hash seed (None: ``JAXKV_HASH_SEED``, if set)."""
        self._block_size = _check_block_size(block_size)
        self._algo = _check_algo(algo)
        self._root = root_hash(algo, block_size, resolve_seed(seed))
        self._digest_size = _DIGEST_SIZES[algo]
        self._step = 4 * block_size
        self._is_sha256 = algo == "sha256"
        self._cbor = algo == "sha256_cbor"
        self._packer = struct.Struct(f"<{block_size}I")

    @property
    def block_size(self) -> int:
        """Tokens per hashed block."""
        return self._block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's ids as the hash reads them (little-endian int32)."""
        return self._step

    @property
    def algo(self) -> str:
        """Hash algorithm name, one of HASH_ALGORITHMS."""
        return self._algo

    @property
    def root(self) -> bytes:
        """Parent hash of block 0 (see root_hash)."""
        return self._root

    @property
    def digest_size(self) -> int:
        """Bytes per block hash."""
        return self._digest_size

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self._block_size}, algo={self._algo!r})"

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> int:
        """Append to `hashes` the hashes of every full block of token_ids not yet hashed
        (block index len(hashes) onwards); return how many were added. Lazy/incremental:
        calling it again after more tokens arrive hashes only the new full blocks.

        On bad input it raises a BlockHashError and leaves `hashes` unchanged. Inputs
        are checked when there is a block to hash: a call that hashes nothing (most
        decode steps) costs two len() calls and inspects nothing.
        """
        first = len(hashes)
        count = len(token_ids) // self._block_size - first
        if count <= 0:
            return 0
        parent = self._parent(hashes, extra)
        bs = self._block_size
        lo = first * bs
        if count == 1 and not self._cbor:  # the decode path: one new block
            message = parent + _token_bytes(token_ids, lo, lo + bs, self._packer)
            if not extra._empty:  # type: ignore[attr-defined]
                message += extra.block_extras(bs, first, 1)[0]
            hashes.append(hashlib.sha256(message).digest() if self._is_sha256 else _xxh3(message))
            return 1
        data = _token_bytes(token_ids, lo, lo + count * bs, self._packer)
        hashes.extend(self._chain(parent, data, 0, first, count, extra))
        return count

    def extend_bytes(self, hashes: list[bytes], token_bytes: bytes, extra: ExtraKeys = NO_EXTRA_KEYS) -> int:
        """:meth:`extend` for token ids already packed as little-endian int32 (4 bytes an
        id, as the hash serializes them): a prompt packed once when it was checked is
        hashed without packing it again. Ids >= 2**31 raise InvalidTokenIdError."""
        if type(token_bytes) is not bytes or len(token_bytes) % 4:
            raise InvalidTokenIdError(f"token_bytes must be bytes of 4 per id, got {token_bytes!r:.80}")
        first = len(hashes)
        step = self._step
        count = len(token_bytes) // step - first
        if count <= 0:
            return 0
        parent = self._parent(hashes, extra)
        lo = first * step
        hi = lo + count * step
        if _top_bit_set(token_bytes, lo, hi):
            raise _bad_token(struct.unpack_from(f"<{(hi - lo) // 4}I", token_bytes, lo), lo // 4)
        hashes.extend(self._chain(parent, token_bytes, lo, first, count, extra))
        return count

    def _parent(self, hashes: list[bytes], extra: ExtraKeys) -> bytes:
        """The parent of the next block of ``hashes``, once ``extra`` and the last hash are checked."""
        if type(extra) is not ExtraKeys:
            raise InvalidExtraKeysError(f"extra must be an ExtraKeys, got {extra!r}")
        if not hashes:
            return self._root
        parent = hashes[-1]
        if type(parent) is not bytes or len(parent) != self._digest_size:
            raise InvalidBlockError(
                f"hashes[-1] must be a {self._digest_size}-byte {self._algo} digest, got {parent!r}"
            )
        return parent

    def hash_block(
        self,
        parent: bytes | None,
        block_token_ids: Sequence[int],
        block_index: int,
        extra: ExtraKeys = NO_EXTRA_KEYS,
    ) -> bytes:
        """Hash one full block: `parent` is the previous block's hash, None for block 0
        (then block_index must be 0, and only then)."""
        parent, data = self._check_block(parent, block_token_ids, block_index, extra)
        return self._chain(parent, data, 0, block_index, 1, extra)[0]

    def serialize_block(
        self,
        parent: bytes | None,
        block_token_ids: Sequence[int],
        block_index: int,
        extra: ExtraKeys = NO_EXTRA_KEYS,
    ) -> bytes:
        """The exact message hash_block digests (for tests, debugging and other
        implementations of the format)."""
        parent, data = self._check_block(parent, block_token_ids, block_index, extra)
        if self._cbor:
            return self._cbor_message(parent, data, 0, block_index, extra)
        return parent + data + extra.block_extras(self._block_size, block_index, 1)[0]

    def _check_block(
        self,
        parent: bytes | None,
        block_token_ids: Sequence[int],
        block_index: int,
        extra: ExtraKeys,
    ) -> tuple[bytes, bytes]:
        """Validate one block's inputs; return (effective parent, token bytes)."""
        if type(extra) is not ExtraKeys:
            raise InvalidExtraKeysError(f"extra must be an ExtraKeys, got {extra!r}")
        check_int("block_index", block_index, minimum=0, error=InvalidBlockError)
        if parent is None:
            if block_index != 0:
                raise InvalidBlockError(f"parent is None but block_index is {block_index}, not 0")
            parent = self._root
        elif block_index == 0:
            raise InvalidBlockError("block 0 chains from the root: its parent must be None")
        elif type(parent) is not bytes or len(parent) != self._digest_size:
            raise InvalidBlockError(f"parent must be a {self._digest_size}-byte {self._algo} digest, got {parent!r}")
        if len(block_token_ids) != self._block_size:
            raise InvalidBlockError(f"a block has {self._block_size} tokens, got {len(block_token_ids)}")
        return parent, _token_bytes(block_token_ids, 0, self._block_size, self._packer)

    def _chain(self, parent: bytes, data: bytes, start: int, first: int, count: int, extra: ExtraKeys) -> list[bytes]:
        """Hash `count` consecutive blocks held in `data` (int32 bytes) from byte `start`
        on, block `first` on."""
        step = self._step
        p = parent
        if self._cbor:
            sha256 = hashlib.sha256
            offsets = range(start, start + count * step, step)
            return [
                p := sha256(self._cbor_message(p, data, i, first + k, extra)).digest() for k, i in enumerate(offsets)
            ]
        # One unpack cuts every block's bytes (~60 ns a block cheaper than slicing each).
        blocks = struct.unpack_from(f"{step}s" * count, data, start)
        if extra._empty:  # type: ignore[attr-defined]
            if self._is_sha256:
                sha256 = hashlib.sha256
                return [p := sha256(p + b).digest() for b in blocks]
            xxh3 = _xxh3
            return [p := xxh3(p + b) for b in blocks]
        suffixes = extra.block_extras(self._block_size, first, count)
        if self._is_sha256:
            sha256 = hashlib.sha256
            return [p := sha256(p + b + s).digest() for b, s in zip(blocks, suffixes, strict=True)]
        xxh3 = _xxh3
        return [p := xxh3(p + b + s) for b, s in zip(blocks, suffixes, strict=True)]

    def _cbor_message(self, parent: bytes, data: bytes, offset: int, index: int, extra: ExtraKeys) -> bytes:
        """sha256_cbor's message for block ``index``, its ids at ``data[offset:]``."""
        if extra.mm_items:
            raise InvalidExtraKeysError("sha256_cbor takes no multimodal items (their keys are vLLM's own)")
        keys = [] if extra.lora_name is None else [extra.lora_name]
        if index == 0 and extra.cache_salt:
            keys.append(extra.cache_salt)
        tokens = self._packer.unpack_from(data, offset)
        return cbor((parent, tokens, tuple(keys) if keys else None))
