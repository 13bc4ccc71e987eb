"""A request's tokens and scheduling progress, as the KV cache manager sees them: the
:class:`Request`, the read-only view of its token ids, :func:`token_id_list`, which
turns what a caller passes into checked token ids, and :func:`append_checked_token_ids`,
a decode step's outputs appended in one loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TypeGuard, overload

import numpy as np

from jaxkv.core.hashing import MAX_TOKEN_ID, NO_EXTRA_KEYS, BlockHasher, ExtraKeys, MultiModalItem, int32_le_bytes
from jaxkv.core.manager_errors import KVCacheManagerError
from jaxkv.core.prompt_digests import PromptDigests
from jaxkv.ints import is_int

MAX_BRANCH_POINTS = 16
"""The most branch points a request names (each may cost a recurrent state)."""


def checked_branch_points(points: object, num_prompt_tokens: int, name: str) -> tuple[int, ...]:
    """``points`` as sorted distinct positions inside a prompt of ``num_prompt_tokens``
    tokens (``0 < p < num_prompt_tokens``), at most :data:`MAX_BRANCH_POINTS`;
    :class:`KVCacheManagerError` naming the first bad value."""
    if isinstance(points, (str, bytes)) or not isinstance(points, (Sequence, np.ndarray)):
        raise KVCacheManagerError(f"{name}: branch_points must be a sequence of positions, got {points!r:.80}")
    if len(points) > MAX_BRANCH_POINTS:
        raise KVCacheManagerError(f"{name}: {len(points)} branch_points, at most {MAX_BRANCH_POINTS}")
    for p in points:
        if not is_int(p) or not 0 < p < num_prompt_tokens:
            raise KVCacheManagerError(
                f"{name}: branch point {p!r} is not a position in (0, {num_prompt_tokens}) of its prompt"
            )
    return tuple(sorted({int(p) for p in points}))


class ReadOnlyTokenIds(Sequence[int]):
    """A read-only view of a request's token ids (slices come back as lists, ids as ints).

    The manager hashes full blocks once and caches them under those hashes, so a token
    edited in place afterwards would cache KV under the hash of tokens never computed;
    tokens only grow through :meth:`Request.append_output_token_ids`.
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: array[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if type(index) is slice:
            return self._ids[index].tolist()
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __add__(self, other: Sequence[int]) -> list[int]:
        return self._ids.tolist() + list(other)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReadOnlyTokenIds):
            return self._ids == other._ids
        return isinstance(other, (list, tuple)) and self._ids.tolist() == list(other)

    def __hash__(self) -> int:
        raise TypeError("ReadOnlyTokenIds is unhashable: it grows as tokens are appended")

    def __repr__(self) -> str:
        return repr(self._ids.tolist())


def _plain_token_ids(values: Sequence[int]) -> tuple[array[int], bytes] | None:
    """``values`` as an ``array("I")`` and as little-endian int32 bytes (what the prefix hash reads)
    when every one is an int in ``[0, MAX_TOKEN_ID]``, checked in bulk (~4x faster than
    per item for a long prompt); None: take the checking path.

    Packing as uint32 refuses non-ints, negatives and ids >= 2**32 (numpy ints pack as
    the ints they are, and the array keeps plain ints); read back as int32, ids >= 2**31
    turn negative. Only the 0s and 1s are looked at one by one, since they may be bools
    (a BOS id of 1 is common, so they must not send the whole prompt the long way).
    """
    try:
        packed = array("I", values)
    except (TypeError, OverflowError, ValueError):
        return None
    if not packed:
        return None
    as_int32 = np.frombuffer(packed, np.int32)
    lowest = as_int32.min()
    if lowest < 0:
        return None
    if lowest <= 1 and any(type(values[i]) is not int for i in np.flatnonzero(as_int32 <= 1).tolist()):
        return None
    return packed, int32_le_bytes(packed)


def _in_range_int_vector(values: object) -> TypeGuard[np.ndarray]:
    """A non-empty 1-D integer array of ids in ``[0, MAX_TOKEN_ID]`` (packed in bulk)."""
    return (
        isinstance(values, np.ndarray)
        and values.ndim == 1
        and values.dtype.kind in "iu"
        and values.size > 0
        and values.min() >= 0
        and values.max() <= MAX_TOKEN_ID
    )


_SHORT = 64
"""Lists up to this long (a decode step's tokens) are checked item by item in C: below
it, packing them for the bulk check costs more than it saves."""


def _only_plain_ints(values: list[object]) -> bool:
    """Every item is an ``int`` proper (no bool, no numpy int)."""
    return list(map(type, values)).count(int) == len(values)


def token_id_list(values: object, what: str) -> list[int]:
    """``values`` as a list of token ids; :class:`KVCacheManagerError` naming the first bad one.

    A 1-D sequence or array of ints (numpy ints too) in ``[0, MAX_TOKEN_ID]``; bools,
    floats, strings, nested lists and 2-D arrays are refused.
    """
    if (
        type(values) is list
        and 0 < len(values) <= _SHORT
        and _only_plain_ints(values)
        and min(values) >= 0
        and max(values) <= MAX_TOKEN_ID
    ):
        return values.copy()
    ids = _checked_token_ids(values, what)[0]
    return ids.tolist() if type(ids) is array else ids  # type: ignore[return-value]


def _checked_token_ids(values: object, what: str) -> tuple[array[int] | list[int], bytes]:
    """:func:`token_id_list`, with the ids as little-endian int32 bytes when the bulk check
    packed them (else ``b""``), so that a prompt is packed once for checking and hashing."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise KVCacheManagerError(f"{what} must be a sequence of token ids, got {values!r:.80}")
    if isinstance(values, (list, tuple)):
        plain = _plain_token_ids(values)
        if plain is not None:
            return plain
    elif _in_range_int_vector(values):
        packed = array("I", values.astype(np.uint32).tobytes())
        return packed, int32_le_bytes(packed)
    ndim = getattr(values, "ndim", 1)
    if ndim != 1:
        raise KVCacheManagerError(f"{what} must be 1-D, got an array of shape {getattr(values, 'shape', None)}")
    ids: list[int] = list(values)  # type: ignore[call-overload]
    if set(map(type, ids)) - {int}:
        bad = [t for t in ids if not is_int(t)][:1]  # is_int refuses bools
        if bad:
            raise KVCacheManagerError(f"{what}: {bad[0]!r} is not a token id (an int)")
        ids = [int(t) for t in ids]
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        outside = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise KVCacheManagerError(f"{what}: token id {outside} is outside [0, {MAX_TOKEN_ID}]")
    return ids, b""


class Request:
    """A request's tokens and scheduling progress, as the KV cache manager sees them.

    ``num_computed_tokens`` is advanced by the caller's scheduler, as in vLLM. Block
    hashes are filled in lazily by the manager, only for full blocks
    (:meth:`extend_block_hashes`). Token ids are checked on the way in and read-only
    afterwards (``all_token_ids`` is a view). What a manager keeps while the request
    holds blocks is the manager's (:class:`~jaxkv.core.held_request.HeldRequest`).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        skip_reading_prefix_cache: bool = False,
        branch_points: Sequence[int] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise KVCacheManagerError(f"request_id must be a non-empty str, got {request_id!r}")
        ids, prompt_bytes = _checked_token_ids(prompt_token_ids, f"request {request_id!r}: prompt_token_ids")
        if not ids:
            raise KVCacheManagerError(f"request {request_id!r} has an empty prompt")
        # Where later prompts are likely to branch off this one (a chat's message boundaries):
        # a recurrent prefill checkpoints its state there (CheckpointPolicy.branch_positions).
        self.branch_points = checked_branch_points(branch_points, len(ids), f"request {request_id!r}")
        self.request_id = request_id
        # The ids live in an array("I"): a long prompt as a list is thousands of
        # references for every garbage collection to visit while the request lives.
        self._token_ids: array[int] = ids if type(ids) is array else array("I", ids)
        # The prompt as little-endian int32 (b"" when it was checked one id at a time):
        # the manager hashes the prompt's blocks from these bytes, not by packing again.
        self._prompt_bytes = prompt_bytes
        self._token_view = ReadOnlyTokenIds(self._token_ids)
        self.num_prompt_tokens = len(ids)
        # A lookup finds no hit for it, so it computes its whole prompt (what scoring every
        # prompt token needs, as vLLM's skip_reading_prefix_cache); its blocks are still cached.
        self.skip_reading_prefix_cache = bool(skip_reading_prefix_cache)
        if cache_salt is None and lora_name is None and mm_items == ():
            self.extra_keys = NO_EXTRA_KEYS
        else:
            self.extra_keys = ExtraKeys(cache_salt=cache_salt, lora_name=lora_name, mm_items=tuple(mm_items))
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        # (block size, algorithm) of the hasher that filled block_hashes.
        self.block_hash_key: tuple[int, str] | None = None
        # Set by a manager's lookup (get_computed_blocks): how far full attention alone
        # matched (the lookup's PrefixHit.reach), read until the next lookup: where a
        # recurrent prefill checkpoints its state, an anchor for group-aware retention.
        self.prefix_reach = 0
        # Set by the same lookup: the prompt's branch-ahead checkpoint positions and those at
        # its branch points past the hit (CheckpointPolicy.ahead, .branch_positions).
        self.checkpoint_ahead: tuple[int, ...] = ()
        # And whether the prompt left a cached chain that goes on (None: it matched none).
        self.prefix_diverged: bool | None = None
        # And whether full attention's match ended where its cached chain ends (a chat turn
        # resuming its previous turn; None: it matched none, or the model has no checkpoints).
        self.prefix_extends: bool | None = None

    @cached_property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (built on first use: the manager never reads them)."""
        return tuple(self._token_ids[: self.num_prompt_tokens])

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._token_ids)

    @property
    def all_token_ids(self) -> ReadOnlyTokenIds:
        """Prompt plus generated tokens (a read-only view)."""
        return self._token_view

    @property
    def prompt_bytes(self) -> bytes:
        """The prompt as little-endian int32 when its check packed it in bulk (what the
        prefix hash reads), else ``b""``."""
        return self._prompt_bytes

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self.num_prompt_tokens :].tolist()

    @property
    def cache_salt(self) -> str | None:
        return self.extra_keys.cache_salt

    @property
    def lora_name(self) -> str | None:
        return self.extra_keys.lora_name

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Record generated tokens (one id or several); a bad id changes nothing."""
        if type(token_ids) is int and 0 <= token_ids <= MAX_TOKEN_ID:
            self._token_ids.append(token_ids)
        elif (
            type(token_ids) is list
            and len(token_ids) == 1
            and type(t := token_ids[0]) is int
            and 0 <= t <= MAX_TOKEN_ID
        ):
            self._token_ids.append(t)
        elif is_int(token_ids):
            self._token_ids.extend(token_id_list([token_ids], f"request {self.request_id!r}: output token"))
        else:
            self._token_ids.extend(token_id_list(token_ids, f"request {self.request_id!r}: output tokens"))

    def extend_block_hashes(self, hasher: BlockHasher, digests: PromptDigests) -> None:
        """Append to ``block_hashes`` the hashes of the full blocks not hashed yet (when
        none became full: two ``len`` calls).

        The prompt's blocks are hashed from the bytes its check packed (those it shares
        with a prompt ``digests`` saw recently are taken from there, not hashed again),
        later blocks from the token ids. The caller keeps one hasher per request
        (``block_hash_key``)."""
        tokens = self._token_ids
        hashes = self.block_hashes
        if len(tokens) >= (len(hashes) + 1) * hasher.block_size:  # a new full block
            prompt = self._prompt_bytes
            if not hashes and len(prompt) >= hasher.block_bytes:
                shared = digests.shared(prompt, self.extra_keys)
                hasher.extend_bytes(shared, prompt, self.extra_keys)
                hashes.extend(shared)
                digests.remember(prompt, self.extra_keys, hashes)
            elif len(hashes) < len(prompt) // hasher.block_bytes:
                hasher.extend_bytes(hashes, prompt, self.extra_keys)
            hasher.extend(hashes, tokens, self.extra_keys)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


def append_checked_token_ids(requests: Sequence[Request], token_ids: Sequence[int]) -> None:
    """Append ``token_ids[i]`` to ``requests[i]``: a decode step's outputs, in one loop
    (:meth:`Request.append_output_token_ids` per token costs ~3x as much). The ids are
    what :func:`token_id_list` returned, one per request: the caller checked them."""
    for request, token in zip(requests, token_ids, strict=True):
        request._token_ids.append(token)
