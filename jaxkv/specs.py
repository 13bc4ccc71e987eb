"""What one layer needs from the KV cache.

A spec is a frozen, hashable description of one layer's cache: how many bytes a page
of ``block_size`` tokens takes (or, for Mamba-like layers, how big the recurrent state
is) and how many blocks one request can hold at its peak. The planner groups layers by
``type_key`` and sizes the shared block pool from these numbers; the managers pick
their allocation rules by spec class.

All specs are keyword-only dataclasses. Dtypes are given by name ("bfloat16",
"float8_e4m3fn", ...) or as a dtype object and are stored as the canonical numpy name.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv, check_int

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens one scheduler step may add to one request (the chunked-prefill chunk)."""

MAMBA_BLOCKS_PER_REQUEST = 2
"""Blocks a running request holds in a Mamba group: the block whose state a step
reads and the block it writes. Writing into a fresh block keeps a state that the
prefix cache may share with other requests intact; older checkpoints are cache
(evictable), not per-request need."""


class SpecError(JaxkvError, ValueError):
    """A spec was built with a value that cannot describe a real layer."""


class SpecMergeError(SpecError):
    """The layers of one group have specs that cannot share a KV cache group."""


def _positive_int(what: str, value: object) -> int:
    return check_int(what, value, minimum=1, error=SpecError)


def canonical_dtype(value: object) -> str:
    """Canonical numpy name of a dtype given by name or object ("f4" -> "float32").

    Accepts numpy and ml_dtypes (bfloat16, float8_*) types of at least 8 bits; sub-byte
    types are rejected because their storage size is not their itemsize.
    """
    try:
        if isinstance(value, str) and hasattr(ml_dtypes, value):
            dtype = np.dtype(getattr(ml_dtypes, value))
        else:
            dtype = np.dtype(value)  # type: ignore[call-overload]
    except TypeError as err:
        raise SpecError(f"unknown dtype {value!r}") from err
    try:
        bits = ml_dtypes.finfo(dtype).bits
    except ValueError:
        try:
            bits = ml_dtypes.iinfo(dtype).bits
        except ValueError as err:
            raise SpecError(f"dtype {value!r} is not a numeric type") from err
    if bits < 8:
        raise SpecError(f"dtype {value!r} has {bits} bits; sub-byte dtypes are not supported")
    return str(dtype.name)


def _dtype_field(owner: str, name: str, value: object) -> str:
    try:
        return canonical_dtype(value)
    except SpecError as err:
        raise SpecError(f"{owner}.{name}: {err}") from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype given by canonical name."""
    if hasattr(ml_dtypes, name):
        return int(np.dtype(getattr(ml_dtypes, name)).itemsize)
    return int(np.dtype(name).itemsize)


def _blocks_touched(num_tokens: int, block_size: int) -> int:
    """Most blocks a run of ``num_tokens`` consecutive tokens can touch."""
    return 1 + cdiv(num_tokens - 1, block_size)


def _set_positive_int(spec: KVCacheSpec, name: str) -> int:
    value = _positive_int(f"{type(spec).__name__}.{name}", getattr(spec, name))
    object.__setattr__(spec, name, value)
    return value


def _check_request_args(max_model_len: int, block_size: int, max_num_batched_tokens: int) -> None:
    _positive_int("max_model_len", max_model_len)
    _positive_int("block_size", block_size)
    _positive_int("max_num_batched_tokens", max_num_batched_tokens)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(abc.ABC):
    """Cache needs of one layer. Subclasses are frozen dataclasses."""

    @abc.abstractmethod
    def page_size_bytes(self, block_size: int) -> int:
        """Bytes one layer's page of ``block_size`` tokens takes (Mamba: the state)."""

    @abc.abstractmethod
    def blocks_per_request(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """Blocks one request of ``max_model_len`` tokens holds at its peak."""

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """Short human-readable kind, for tables ("sliding_window(1024)")."""

    @property
    def type_key(self) -> Hashable:
        """Layers with equal type_key may share a KV cache group: class and all fields."""
        return (type(self).__name__, *tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def max_memory_bytes(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """Bytes this layer needs for one request of ``max_model_len`` tokens."""
        blocks = self.blocks_per_request(max_model_len, block_size, max_num_batched_tokens)
        return blocks * self.page_size_bytes(block_size)

    @classmethod
    def merge(cls, specs: Iterable[KVCacheSpec]) -> KVCacheSpec:
        """The spec of a group made of layers with ``specs``.

        Layers share a group only if their specs have the same ``type_key`` (and are
        instances of ``cls``); anything else is a :class:`SpecMergeError`.
        """
        specs = tuple(specs)
        if not specs:
            raise SpecMergeError(f"{cls.__name__}.merge needs at least one spec, got none")
        for spec in specs:
            if not isinstance(spec, cls):
                raise SpecMergeError(f"{cls.__name__}.merge got a {type(spec).__name__}: {spec!r}")
            if spec.type_key != specs[0].type_key:
                raise SpecMergeError(f"cannot merge {specs[0]!r} with {spec!r}: different type_key")
        return specs[0]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A paged K/V cache: every token stores a key and a value per KV head."""

    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _set_positive_int(self, "num_kv_heads")
        _set_positive_int(self, "head_size")
        object.__setattr__(self, "dtype", _dtype_field(type(self).__name__, "dtype", self.dtype))

    @property
    def itemsize(self) -> int:
        """Bytes per cache element."""
        return dtype_itemsize(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer (K and V)."""
        return 2 * self.num_kv_heads * self.head_size * self.itemsize

    def page_size_bytes(self, block_size: int) -> int:
        return _positive_int("block_size", block_size) * self.bytes_per_token

    def blocks_per_request(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """cdiv(L, bs): a request keeps all its tokens unless a subclass says otherwise."""
        _check_request_args(max_model_len, block_size, max_num_batched_tokens)
        return cdiv(max_model_len, block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: a request keeps all its tokens."""

    @property
    def label(self) -> str:
        return "full_attention"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention to the last ``sliding_window`` tokens (the query's own included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _set_positive_int(self, "sliding_window")

    @property
    def label(self) -> str:
        return f"sliding_window({self.sliding_window})"

    def blocks_per_request(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """min(cdiv(L, bs), 1 + cdiv(W - 2 + B, bs)).

        A step adds up to B tokens and its first query still sees W - 1 older ones,
        so a span of T = W - 1 + B consecutive tokens must be resident (older blocks
        are released by the manager). T tokens starting anywhere in a block touch at
        most 1 + cdiv(T - 1, bs) blocks; a request never holds more blocks than its
        whole length needs. This is the exact worst case, and at most the
        cdiv(T, bs) + 1 that vLLM reserves.
        """
        _check_request_args(max_model_len, block_size, max_num_batched_tokens)
        span = self.sliding_window - 1 + max_num_batched_tokens
        return min(cdiv(max_model_len, block_size), _blocks_touched(span, block_size))


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4)."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _set_positive_int(self, "attention_chunk_size")

    @property
    def label(self) -> str:
        return f"chunked_local({self.attention_chunk_size})"

    def blocks_per_request(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """min(cdiv(L, bs), cdiv(T, bs)) with T = C - 1 + B, if bs divides C.

        A step of up to B tokens sees back to the start of its first query's chunk:
        at most T = C - 1 + B tokens from a chunk boundary, which is a block boundary
        when bs divides C. Otherwise the span may start anywhere in a block and
        touches up to 1 + cdiv(T - 1, bs) blocks.
        """
        _check_request_args(max_model_len, block_size, max_num_batched_tokens)
        span = self.attention_chunk_size - 1 + max_num_batched_tokens
        if self.attention_chunk_size % block_size == 0:
            chunk_blocks = cdiv(span, block_size)
        else:
            chunk_blocks = _blocks_touched(span, block_size)
        return min(cdiv(max_model_len, block_size), chunk_blocks)


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """Multi-head latent attention (DeepSeek): one compressed latent per token.

    The latent (``kv_lora_rank``) and the decoupled RoPE key (``qk_rope_head_dim``)
    are cached together, with no separate V; ``num_kv_heads`` is 1 and ``head_size``
    is their sum, both derived.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    num_kv_heads: int = field(init=False, default=1)
    head_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        rank = _set_positive_int(self, "kv_lora_rank")
        rope = _set_positive_int(self, "qk_rope_head_dim")
        object.__setattr__(self, "head_size", rank + rope)
        super().__post_init__()

    @property
    def label(self) -> str:
        return "mla"

    @property
    def bytes_per_token(self) -> int:
        return self.head_size * self.itemsize


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A fixed-size recurrent state per request (Mamba-1/2, gated delta-net, ...).

    ``shapes`` are the per-layer state tensors (e.g. conv state, SSM state) and
    ``dtypes`` their dtypes, one per shape. ``mamba_type`` names the recurrence; layers
    with different recurrences never share a group.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_type: str = "mamba"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.shapes, (str, bytes)) or not isinstance(self.shapes, Sequence):
            raise SpecError(f"{owner}.shapes must be a sequence of shapes, got {self.shapes!r}")
        if isinstance(self.dtypes, (str, bytes)) or not isinstance(self.dtypes, Sequence):
            raise SpecError(f"{owner}.dtypes must be a sequence of dtypes, got {self.dtypes!r}")
        if not self.shapes:
            raise SpecError(f"{owner}.shapes is empty; a state needs at least one tensor")
        if len(self.shapes) != len(self.dtypes):
            raise SpecError(
                f"{owner} has {len(self.shapes)} shapes {self.shapes!r} but {len(self.dtypes)} dtypes {self.dtypes!r}"
            )
        shapes = []
        for shape in self.shapes:
            if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
                raise SpecError(f"{owner} state shape must be a non-empty tuple, got {shape!r}")
            shapes.append(tuple(_positive_int(f"{owner} dim of shape {shape!r}", d) for d in shape))
        object.__setattr__(self, "shapes", tuple(shapes))
        dtypes = tuple(_dtype_field(owner, "dtypes", d) for d in self.dtypes)
        object.__setattr__(self, "dtypes", dtypes)
        if not isinstance(self.mamba_type, str) or not self.mamba_type:
            raise SpecError(f"{owner}.mamba_type must be a non-empty str, got {self.mamba_type!r}")

    @property
    def label(self) -> str:
        return self.mamba_type

    @property
    def state_bytes(self) -> int:
        """Bytes of one layer's state for one request (all tensors)."""
        return sum(
            math.prod(shape) * dtype_itemsize(dtype) for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    def page_size_bytes(self, block_size: int) -> int:
        """The state size; a Mamba page holds one state whatever the block size."""
        return self.state_bytes

    def blocks_per_request(
        self,
        max_model_len: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        """:data:`MAMBA_BLOCKS_PER_REQUEST`, whatever the length."""
        _check_request_args(max_model_len, block_size, max_num_batched_tokens)
        return MAMBA_BLOCKS_PER_REQUEST
