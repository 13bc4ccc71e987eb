"""Plan device memory for the KV cache of a (hybrid) model.

specs -> (tile alignment) -> groups -> block size per group -> layout -> num_blocks:

0. **Tile alignment.** With ``head_dim_multiple`` m > 1, the ``head_size`` of every
   full, sliding-window and chunked-local attention spec is rounded up to a multiple
   of m (TPU: :data:`TPU_HEAD_DIM_MULTIPLE`) before anything else, so every number of
   the plan (pages, blocks, num_blocks, padding, the summary) counts the padded bytes
   the device buffers really take. MLA latents and Mamba states are left as they are.
1. **Groups.** Layers whose specs have the same ``type_key`` form a type. Every group
   has the same number of layers per block, ``layers_per_group`` (see
   :func:`choose_layers_per_group`); a type's layers are dealt round-robin into
   ceil(count / layers_per_group) groups (vLLM's order: layers 3-6 in two groups
   are [3, 5] and [4, 6]). One block id then means the
   same bytes in every group, so all groups draw from one shared pool.
2. **Pages.** Slot i of every group is the same memory, so one layer's page must be
   the same size in every group. Attention types with a smaller page get a block size
   scaled by an integer factor; Mamba states are padded up to the page, after the
   attention block size has grown in multiples of ``block_size`` until a page holds a
   state.
3. **Blocks.** ``num_blocks = memory_bytes // block_bytes``, block 0 (the null block)
   included; the budget must hold one max_model_len request plus the null block.

Steps 2-3 are vLLM's rule (``state_layout="attention_pages"``, the default). With
``state_layout="state_pool"`` the recurrent layers leave the pages: attention types
are planned as if they were alone (blocks stay ``block_size`` tokens), each Mamba type
becomes one group whose blocks are rows of a separate pool of states, and the budget
is split between the two pools (see :func:`plan_kv_cache`). Prefix caching then works
at the attention block size instead of the 100s-1000s of tokens a page needs to hold
a state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv, check_int
from jaxkv.plan_summary import exact_bytes, plan_summary
from jaxkv.specs import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

Layout = Literal["cross_layer", "per_layer"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
"""``cross_layer``: block-major, all layers of a block contiguous (one buffer of
(num_blocks, num_layers_per_block, page)), so a block moves in one copy. ``per_layer``: one
buffer of (num_blocks, page) per layer index."""

StateLayout = Literal["attention_pages", "state_pool", "shared_pages"]
STATE_LAYOUTS: tuple[StateLayout, ...] = get_args(StateLayout)
"""Where recurrent states live. ``attention_pages``: vLLM's rule, one attention page
holds one state (the attention block size grows until it does). ``state_pool``: a pool
of state rows apart from the attention pages (:class:`StatePool`), split at plan
time. ``shared_pages``: one memory: a state is ``k`` pages of the attention block pool
(:class:`SharedStates`), taken and evicted as a unit, so KV blocks, live states and
state checkpoints share one pool and one eviction order decided at run time."""

DEFAULT_STATE_LAYOUT: StateLayout = "shared_pages"
"""What :func:`default_state_layout` picks for models with recurrent layers."""


def default_state_layout(layer_specs: Mapping[str, KVCacheSpec], tensor_parallel: int = 1) -> StateLayout:
    """The state layout ``state_layout=None`` picks: ``shared_pages`` for a model with
    recurrent (Mamba) and attention layers, ``state_pool`` for one with recurrent layers
    alone (no pages to share) or split over ``tensor_parallel`` > 1 devices (its KV pages
    are split by heads, a state is not), else ``attention_pages`` (nothing to place)."""
    recurrent = [isinstance(s, MambaSpec) for s in layer_specs.values()]
    if all(recurrent) or (any(recurrent) and tensor_parallel > 1):
        return "state_pool"
    return DEFAULT_STATE_LAYOUT if any(recurrent) else "attention_pages"


@dataclass(frozen=True)
class StatePoolOptions:
    """The state pool's sizes, checked when built: ``max_num_seqs`` live states (None:
    balanced against the attention blocks) and ``checkpoint_bytes`` of the budget kept
    for prefix-cache state checkpoints. Only ``state_layout="state_pool"`` takes them,
    so they travel together in :attr:`PlanOptions.state_pool`."""

    max_num_seqs: int | None = None
    checkpoint_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None:
            _positive_int("max_num_seqs", self.max_num_seqs)
        check_int("checkpoint_bytes", self.checkpoint_bytes, minimum=0, error=PlanError)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan, beyond the specs, the budget and ``max_model_len``: one frozen
    object checked when built, which the Engine and the commands pass through whole.

    - ``block_size``: base tokens per block (a group's block is a multiple of it).
    - ``layout``: :data:`LAYOUTS`, how block bytes lie in the buffers.
    - ``max_num_batched_tokens``: tokens one step may add to a request (it sizes
      sliding-window and chunked spans). None: the step budget of whoever plans:
      :data:`~jaxkv.specs.DEFAULT_MAX_NUM_BATCHED_TOKENS` for the planner, its own for
      an Engine.
    - ``head_dim_multiple``: the ``head_size`` of full, sliding-window and
      chunked-local attention specs is rounded up to a multiple of it before planning
      (TPU: :data:`TPU_HEAD_DIM_MULTIPLE`), so the plan counts the padded bytes that
      :func:`jaxkv.device.cache.allocate_kv_cache` allocates; MLA and Mamba specs are
      planned unchanged. None: the device's tile, which the planner (seeing no device)
      takes as 1 and the Engine as its backend's.
    - ``state_layout``: where Mamba states live (:data:`STATE_LAYOUTS`); None picks for
      the model and ``tensor_parallel`` (:func:`default_state_layout`). The commands
      spell None ``auto``.
    - ``state_pool``: the state pool's sizes (:class:`StatePoolOptions`; None: its
      defaults), used when the layout is, or None picks, ``state_pool``; refused beside
      another explicit layout.
    - ``tensor_parallel``: devices every attention block's KV heads are split over (a
      mesh's model axis; :attr:`KVCacheConfig.device_bytes`).
    - ``num_blocks_override``: this many blocks instead of all that fit
      (``attention_pages`` only: the other layouts place blocks and states themselves).
    """

    block_size: int = 16
    layout: Layout = "cross_layer"
    max_num_batched_tokens: int | None = None
    head_dim_multiple: int | None = None
    state_layout: StateLayout | None = None
    state_pool: StatePoolOptions | None = None
    tensor_parallel: int = 1
    num_blocks_override: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.layout not in LAYOUTS:
            raise PlanError(_unknown_layout(self.layout))
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.head_dim_multiple is not None:
            _positive_int("head_dim_multiple", self.head_dim_multiple)
        if self.state_layout is not None and self.state_layout not in STATE_LAYOUTS:
            raise PlanError(
                f"unknown state_layout {self.state_layout!r}; valid state layouts: {', '.join(STATE_LAYOUTS)} "
                "(or None: picked for the model)"
            )
        if self.state_pool is not None:
            if not isinstance(self.state_pool, StatePoolOptions):
                raise PlanError(f"state_pool must be a StatePoolOptions or None, got {self.state_pool!r}")
            if self.state_layout not in (None, "state_pool"):
                sizes = self.state_pool
                raise PlanError(
                    f"max_num_seqs={sizes.max_num_seqs} and checkpoint_bytes={sizes.checkpoint_bytes} size a state "
                    f"pool; state_layout={self.state_layout!r} has none (use 'state_pool' or None)"
                )
        _positive_int("tensor_parallel", self.tensor_parallel)
        if self.num_blocks_override is not None:
            _positive_int("num_blocks_override", self.num_blocks_override)

    @property
    def step_tokens(self) -> int:
        """The step budget the planner sizes spans for (None: the default)."""
        return DEFAULT_MAX_NUM_BATCHED_TOKENS if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    @property
    def tile(self) -> int:
        """The head size multiple the planner pads to (None: 1)."""
        return 1 if self.head_dim_multiple is None else self.head_dim_multiple

    def state_layout_for(self, layer_specs: Mapping[str, KVCacheSpec]) -> StateLayout:
        """The state layout a plan of ``layer_specs`` uses: the given one, or the pick."""
        if self.state_layout is not None:
            return self.state_layout
        return default_state_layout(layer_specs, self.tensor_parallel)


TPU_HEAD_DIM_MULTIPLE = 128
"""``head_dim_multiple`` for TPUs: a vreg is 8 sublanes x 128 lanes and Mosaic kernels
want the minor dim a multiple of 128, so a head of 64 is padded to 128 (2x the bytes)."""

PADDED_HEAD_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
"""Spec classes whose ``head_size`` ``head_dim_multiple`` rounds up (not MLA, not Mamba)."""


class PlanError(JaxkvError, ValueError):
    """The planner was given an argument it cannot plan with."""


class IncompatibleSpecsError(PlanError):
    """Layer types whose pages cannot be made equal."""


class InsufficientMemoryError(PlanError):
    """The budget cannot hold one request of ``max_model_len`` tokens."""


class TensorParallelError(PlanError):
    """A plan whose KV cache cannot be split over ``tensor_parallel`` devices by KV heads."""


def _positive_int(name: str, value: object) -> int:
    return check_int(name, value, minimum=1, error=PlanError)


def pad_head_size(spec: KVCacheSpec, multiple: int) -> KVCacheSpec:
    """``spec`` with its ``head_size`` rounded up to a multiple of ``multiple``.

    Only :data:`PADDED_HEAD_SPECS` are padded; other specs (MLA, Mamba) and heads
    already aligned come back unchanged (the same object).
    """
    if not isinstance(spec, PADDED_HEAD_SPECS) or spec.head_size % multiple == 0:
        return spec
    return dataclasses.replace(spec, head_size=cdiv(spec.head_size, multiple) * multiple)


def _unknown_layout(kind: object) -> str:
    return f"unknown layout {kind!r}; valid layouts: {', '.join(LAYOUTS)}"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table; ``spec`` is their merged spec.

    ``head_padding_bytes_per_token`` is what tile alignment added to one token of all
    the group's layers together (zero head columns, no data); the planner sets it.
    """

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    block_size: int
    head_padding_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layer_names, str) or not isinstance(self.layer_names, Sequence):
            raise PlanError(f"layer_names must be a sequence of names, got {self.layer_names!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise PlanError("a KVCacheGroup needs at least one layer, got layer_names=()")
        if not isinstance(self.spec, KVCacheSpec):
            raise PlanError(f"spec must be a KVCacheSpec, got {self.spec!r}")
        _positive_int("block_size", self.block_size)
        check_int("head_padding_bytes_per_token", self.head_padding_bytes_per_token, minimum=0, error=PlanError)


@dataclass(frozen=True)
class BlockPages:
    """How blocks map to bytes.

    ``layers[i]`` is the i-th layer of every group (None where a group has fewer
    layers): layers of different groups share layer index i, because a block belongs
    to one group at a time. Every layer index of a block is one page of
    ``page_size_bytes``.
    """

    layout: Layout
    layers: tuple[tuple[str | None, ...], ...]
    page_size_bytes: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise PlanError(_unknown_layout(self.layout))
        _positive_int("page_size_bytes", self.page_size_bytes)
        object.__setattr__(self, "layers", tuple(tuple(row) for row in self.layers))
        if not self.layers or len({len(row) for row in self.layers}) != 1 or not self.layers[0]:
            raise PlanError(f"layers must be a non-empty rectangle, got {self.layers!r}")
        names = [name for row in self.layers for name in row if name is not None]
        if len(names) != len(set(names)):
            raise PlanError(f"a layer appears at more than one layer index: {self.layers!r}")

    @property
    def num_layers_per_block(self) -> int:
        """Pages per block (= layers_per_group)."""
        return len(self.layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id: one page per layer index."""
        return self.page_size_bytes * self.num_layers_per_block

    def layer_index(self, layer_name: str) -> int:
        """The layer index (page of a block, buffer of the per-layer layout) holding ``layer_name``'s pages."""
        for i, row in enumerate(self.layers):
            if layer_name in row:
                return i
        raise KeyError(f"layer {layer_name!r} is not in this layout")


@dataclass(frozen=True)
class StatePool:
    """Recurrent states held apart from the attention block pool.

    With a state pool, the recurrent (``MambaSpec``) groups draw their blocks from a
    pool of ``num_states`` states (state 0 is the null state, never handed out) instead
    of the shared attention pool, and their block size is the hash block size, so state
    checkpoints sit at attention-block granularity whatever a state weighs. Without
    one (vLLM's rule), one attention page holds one state.

    One row of ``state_bytes`` holds the states of all layers of one recurrent group,
    for one request at one token position. ``num_live_states`` slots are sized for the
    running requests (one per request and recurrent group, updated in place); the other
    usable slots are budgeted for prefix-cache checkpoints. Hand-built pools may leave
    ``state_bytes`` and ``num_live_states`` unset (None).
    """

    num_states: int
    state_bytes: int | None = None
    num_live_states: int | None = None

    def __post_init__(self) -> None:
        check_int("num_states", self.num_states, minimum=2, error=PlanError)
        if self.state_bytes is not None:
            _positive_int("state_bytes", self.state_bytes)
        if self.num_live_states is not None:
            check_int("num_live_states", self.num_live_states, minimum=1, error=PlanError)
            if self.num_live_states > self.num_states - 1:
                raise PlanError(
                    f"num_live_states={self.num_live_states} exceeds the {self.num_states - 1} usable "
                    f"states of num_states={self.num_states} (state 0 is the null state)"
                )

    @property
    def num_checkpoint_states(self) -> int | None:
        """Usable states beyond the live ones: room for prefix-cache checkpoints."""
        if self.num_live_states is None:
            return None
        return self.num_states - 1 - self.num_live_states

    @property
    def total_bytes(self) -> int | None:
        """Bytes of the whole pool, null state included (None without ``state_bytes``)."""
        return None if self.state_bytes is None else self.num_states * self.state_bytes


@dataclass(frozen=True)
class SharedStates:
    """Recurrent states stored as pages of the attention block pool (one memory).

    A state (all layers of one recurrent group, one request, one position) takes
    ``pages_per_state`` blocks = ceil(``state_bytes`` / block bytes) of the shared pool,
    allocated, cached and evicted as a unit: a live state is held by its request, a
    checkpoint waits in the free queue with the KV blocks and leaves it as a whole.
    """

    pages_per_state: int
    state_bytes: int

    def __post_init__(self) -> None:
        _positive_int("pages_per_state", self.pages_per_state)
        _positive_int("state_bytes", self.state_bytes)


def held_blocks(
    groups: Sequence[KVCacheGroup], state_unit: int | None, num_tokens: int, max_num_batched_tokens: int
) -> tuple[int, ...]:
    """The most blocks one request of ``num_tokens`` tokens holds at once, per group: the
    one count of what the manager holds, which the planner sizes every layout with.

    An attention group holds what its spec says (all blocks, or a window's span for a
    step of ``max_num_batched_tokens``). In vLLM's layout (``state_unit`` None) a
    recurrent group holds the block a step reads and the one it writes. Otherwise its
    state is a unit of ``state_unit`` blocks of its pool (1: a state pool row; a state
    on shared pages: ``pages_per_state``) and the request holds one, its live state: the
    checkpoint a step reads is kept beside it only while the pool has room and is
    written over when it is short (:meth:`jaxkv.core.coordinator.KVCacheCoordinator.allocate`).
    """
    return tuple(
        state_unit
        if state_unit is not None and isinstance(g.spec, MambaSpec)
        else g.spec.blocks_per_request(num_tokens, g.block_size, max_num_batched_tokens)
        for g in groups
    )


@dataclass(frozen=True)
class KVCacheConfig:
    """The plan: the shared pool of ``num_blocks`` blocks and the groups drawing on it.

    ``num_blocks`` includes block 0, the null block, which is never handed out.
    ``layout`` may be None in hand-built configs (tests of the host manager);
    ``max_model_len`` and ``memory_bytes`` are set by the planner, and
    ``head_dim_multiple`` is the tile alignment the group specs were padded to (their
    ``head_size`` is already the padded one). Every group block size is a multiple of
    the smallest (``hash_block_size``): the manager hashes at that granularity.
    With a ``state_pool``, the recurrent groups (``state_group_ids``) take their blocks
    from it: ``num_blocks`` and ``pages`` cover the attention groups only (``pages`` is
    None when there are none).
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    pages: BlockPages | None = None
    max_model_len: int | None = None
    memory_bytes: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    head_dim_multiple: int = 1
    states: StatePool | SharedStates | None = None
    """Where the recurrent groups' states live: a :class:`StatePool` of their own
    (``state_pool``), :class:`SharedStates` in the pages of the ``num_blocks`` pool
    (``shared_pages``), or None (``attention_pages``: one attention page holds a state)."""
    tensor_parallel: int = 1
    """Devices the KV heads are split over (a mesh's model axis): each device holds
    ``num_kv_heads / tensor_parallel`` heads of every attention block, and a whole copy
    of the state pool (recurrent states are replicated)."""

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks)
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise PlanError("a KVCacheConfig needs at least one group, got groups=()")
        for group in self.groups:
            if not isinstance(group, KVCacheGroup):
                raise PlanError(f"groups must hold KVCacheGroup, got {group!r}")
        names = [name for group in self.groups for name in group.layer_names]
        if len(names) != len(set(names)):
            raise PlanError(f"a layer is in more than one group: {names!r}")
        smallest = self.hash_block_size
        for group in self.groups:
            if group.block_size % smallest:
                raise PlanError(
                    f"block sizes must be multiples of the smallest ({smallest}), "
                    f"got {group.block_size} for {group.layer_names[0]!r}"
                )
        if isinstance(self.states, StatePool):
            _check_state_pool(self.groups, self.states)
        elif isinstance(self.states, SharedStates):
            _check_state_pool(self.groups, StatePool(num_states=2))
        elif self.states is not None:
            raise PlanError(f"states must be a StatePool, SharedStates or None, got {self.states!r}")
        if self.pages is not None:
            _check_pages_fit(self.attention_groups, self.pages)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.memory_bytes is not None:
            _positive_int("memory_bytes", self.memory_bytes)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("head_dim_multiple", self.head_dim_multiple)
        _positive_int("tensor_parallel", self.tensor_parallel)
        if self.tensor_parallel > 1:
            _check_tensor_parallel(self.attention_groups, self.tensor_parallel)

    @property
    def state_pool(self) -> StatePool | None:
        """The recurrent states' own pool (``states`` with the ``state_pool`` layout), else None."""
        return self.states if isinstance(self.states, StatePool) else None

    @property
    def shared_states(self) -> SharedStates | None:
        """The recurrent states' place in the block pool's pages (``states`` with the
        ``shared_pages`` layout), else None."""
        return self.states if isinstance(self.states, SharedStates) else None

    @property
    def device_bytes(self) -> int | None:
        """Bytes one tensor-parallel device holds: its share of the attention blocks (1 /
        ``tensor_parallel`` of their KV heads) and the whole state pool (None when the
        plan has no page layout)."""
        if self.pages is None and self.state_pool is None:
            return None
        if self.shared_states is not None:
            assert self.pages is not None  # shared states have no state pool: the pages are there
            return self.num_blocks * self.pages.block_bytes // self.tensor_parallel
        states = 0 if self.state_pool is None else self.state_pool.total_bytes
        if states is None:
            return None
        attention = self.num_blocks * self.pages.block_bytes // self.tensor_parallel if self.pages is not None else 0
        return attention + states

    @property
    def state_group_ids(self) -> tuple[int, ...]:
        """Groups whose blocks are recurrent states: from the state pool, or pages of the
        shared pool with ``shared_states`` (none otherwise)."""
        if self.state_pool is None and self.shared_states is None:
            return ()
        return tuple(i for i, g in enumerate(self.groups) if isinstance(g.spec, MambaSpec))

    @property
    def attention_groups(self) -> tuple[KVCacheGroup, ...]:
        """Groups whose blocks come from the ``num_blocks`` pool (all groups without a state pool)."""
        states = set(self.state_group_ids)
        return tuple(g for i, g in enumerate(self.groups) if i not in states)

    @property
    def hash_block_size(self) -> int:
        """The smallest group block size: the granularity of prefix hashes."""
        return min(group.block_size for group in self.groups)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    def blocks_per_request(self, num_tokens: int | None = None) -> tuple[int, ...]:
        """Blocks one request of ``num_tokens`` (default max_model_len) holds, per group.

        A group on the state pool holds one state (its running state, updated in
        place), drawn from the state pool, not from the ``num_blocks`` pool; with shared
        pages that state is ``pages_per_state`` blocks of the ``num_blocks`` pool.
        """
        num_tokens = self.max_model_len if num_tokens is None else num_tokens
        if num_tokens is None:
            raise PlanError("blocks_per_request needs num_tokens: the config has no max_model_len")
        shared = self.shared_states
        unit = None if self.states is None else shared.pages_per_state if shared is not None else 1
        return held_blocks(self.groups, unit, num_tokens, self.max_num_batched_tokens)

    def attention_blocks_per_request(self, num_tokens: int | None = None) -> int:
        """Blocks of the ``num_blocks`` pool one request of ``num_tokens`` holds, all groups together
        (its live states' pages too with shared pages)."""
        if self.shared_states is not None:
            return sum(self.blocks_per_request(num_tokens))
        states = set(self.state_group_ids)
        return sum(b for i, b in enumerate(self.blocks_per_request(num_tokens)) if i not in states)

    @property
    def max_concurrency(self) -> int | None:
        """How many max_model_len requests fit at once (None without max_model_len).

        With a state pool: the smaller of what the attention blocks allow and what the
        usable states allow (one per request and recurrent group).
        """
        if self.max_model_len is None:
            return None
        limits = []
        need = self.attention_blocks_per_request()
        if need:
            limits.append(self.num_usable_blocks // need)
        if self.state_pool is not None:
            limits.append((self.state_pool.num_states - 1) // len(self.state_group_ids))
        return min(limits)

    @property
    def padding_bytes_per_block(self) -> tuple[int, ...] | None:
        """Bytes of a block that hold no data, per group: empty layer pages, state padding and
        head padding (tile alignment). A state-pool group's block is a state row: its
        padding is what the row holds beyond the group's states (0 if the row size is unknown)."""
        if self.pages is None and self.state_pool is None:
            return None
        states = set(self.state_group_ids)
        padding = []
        for i, g in enumerate(self.groups):
            if i in states and self.shared_states is not None:
                shared = self.shared_states
                # shared states have no state pool (so the pages are there); state groups are Mamba's
                assert self.pages is not None and isinstance(g.spec, MambaSpec)
                padding.append(
                    shared.pages_per_state * self.pages.block_bytes - len(g.layer_names) * g.spec.state_bytes
                )
                continue
            if i in states:
                assert self.state_pool is not None and isinstance(g.spec, MambaSpec)  # state groups: a pool's
                row_bytes = self.state_pool.state_bytes
                padding.append(0 if row_bytes is None else row_bytes - len(g.layer_names) * g.spec.state_bytes)
                continue
            assert self.pages is not None  # attention groups live on the pages
            page = self.pages.page_size_bytes
            padding.append(
                (self.pages.num_layers_per_block - len(g.layer_names)) * page
                + len(g.layer_names) * (page - g.spec.page_size_bytes(g.block_size))
                + g.block_size * g.head_padding_bytes_per_token
            )
        return tuple(padding)

    def summary(self) -> str:
        """A readable table of the plan (:func:`jaxkv.plan_summary.plan_summary`)."""
        return plan_summary(self)


def _check_pages_fit(groups: Sequence[KVCacheGroup], pages: BlockPages) -> None:
    """Column i of the layers must list group i's layers, and every page must fit."""
    if len(pages.layers[0]) != len(groups):
        raise PlanError(f"layout has {len(pages.layers[0])} group columns for {len(groups)} groups")
    for i, group in enumerate(groups):
        column = tuple(row[i] for row in pages.layers)
        expected = group.layer_names + (None,) * (pages.num_layers_per_block - len(group.layer_names))
        if column != expected:
            raise PlanError(f"layout column {i} is {column!r}, group {i} has {group.layer_names!r}")
        data = group.spec.page_size_bytes(group.block_size)
        if data > pages.page_size_bytes:
            raise PlanError(f"group {i} needs {data} B pages but the layout page is {pages.page_size_bytes} B")


def _check_tensor_parallel(groups: Sequence[KVCacheGroup], tensor_parallel: int) -> None:
    """Every group on the attention pages must split into whole KV heads per device."""
    for group in groups:
        if not isinstance(group.spec, PADDED_HEAD_SPECS):
            raise TensorParallelError(
                f"group of {group.layer_names[0]!r} has spec {group.spec!r}, whose pages cannot be split by "
                f"KV heads over tensor_parallel={tensor_parallel} devices (recurrent states: use "
                "state_layout='state_pool', whose states are replicated)"
            )
        heads = group.spec.num_kv_heads
        if heads % tensor_parallel:
            raise TensorParallelError(
                f"num_kv_heads={heads} of group {group.layer_names[0]!r} is not a multiple of "
                f"tensor_parallel={tensor_parallel}; every device must hold whole KV heads"
            )


def _check_state_pool(groups: Sequence[KVCacheGroup], state_pool: object) -> None:
    """A state pool needs recurrent groups, each at the hash block size."""
    if not isinstance(state_pool, StatePool):
        raise PlanError(f"state_pool must be a StatePool or None, got {state_pool!r}")
    recurrent = [g for g in groups if isinstance(g.spec, MambaSpec)]
    if not recurrent:
        raise PlanError("a state_pool needs at least one recurrent (MambaSpec) group")
    smallest = min(g.block_size for g in groups)
    for group in recurrent:
        if group.block_size != smallest:
            raise PlanError(
                f"a recurrent group on the state pool must use the hash block size {smallest}, "
                f"got {group.block_size} for {group.layer_names[0]!r}"
            )


@dataclass(frozen=True)
class _LayerType:
    spec: KVCacheSpec
    layer_names: tuple[str, ...]


def _layer_types(layer_specs: Mapping[str, KVCacheSpec]) -> list[_LayerType]:
    """Layers grouped by type_key, types in order of first appearance."""
    by_key: dict[object, list[str]] = {}
    specs: dict[object, list[KVCacheSpec]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(name, str) or not name:
            raise PlanError(f"layer names must be non-empty str, got {name!r}")
        if not isinstance(spec, KVCacheSpec):
            raise PlanError(f"layer {name!r} has no KVCacheSpec: {spec!r}")
        by_key.setdefault(spec.type_key, []).append(name)
        specs.setdefault(spec.type_key, []).append(spec)
    return [_LayerType(type(specs[key][0]).merge(specs[key]), tuple(names)) for key, names in by_key.items()]


def _unify_pages(specs: Sequence[KVCacheSpec], block_size: int) -> tuple[list[int], int]:
    """Block size per spec and the common page size (bytes per layer page).

    Attention pages are made equal by scaling the block size of the smaller pages by
    the integer ratio to the largest; then all attention block sizes grow by the
    smallest factor k with page * k >= every Mamba state, and states pad up to the
    page. Mamba groups use the smallest attention block size (``block_size`` if
    there is no attention).
    """
    attention = [s for s in specs if not isinstance(s, MambaSpec)]
    states = [s.state_bytes for s in specs if isinstance(s, MambaSpec)]
    if not attention:
        return [block_size] * len(specs), max(states)
    largest = max(s.page_size_bytes(block_size) for s in attention)
    factors = {}
    for spec in attention:
        page = spec.page_size_bytes(block_size)
        if largest % page:
            raise IncompatibleSpecsError(
                f"page of {spec!r} ({page} B at block {block_size}) does not divide the "
                f"largest page ({largest} B); block sizes cannot make them equal"
            )
        factors[spec] = largest // page
    grow = max([1] + [cdiv(state, largest) for state in states])
    attention_block = block_size * grow
    sizes = [attention_block if isinstance(s, MambaSpec) else attention_block * factors[s] for s in specs]
    return sizes, largest * grow


def _head_padding_bytes_per_token(
    names: Sequence[str],
    original: Mapping[str, KVCacheSpec],
    padded: Mapping[str, KVCacheSpec],
) -> int:
    """Bytes per token that tile alignment added to the layers ``names``, together."""
    return sum(
        _bytes_per_token(padded[n]) - _bytes_per_token(original[n]) for n in names if padded[n] is not original[n]
    )


def _state_bytes(spec: KVCacheSpec) -> int:
    """A recurrent layer's state bytes (``PlanError`` for a spec without a state)."""
    if not isinstance(spec, MambaSpec):
        raise PlanError(f"{spec!r} holds no recurrent state")
    return spec.state_bytes


def _bytes_per_token(spec: KVCacheSpec) -> int:
    """An attention layer's bytes per token (``PlanError`` for a spec without tokens)."""
    if not isinstance(spec, AttentionSpec):
        raise PlanError(f"{spec!r} holds no per-token KV")
    return spec.bytes_per_token


def _num_groups(counts: Sequence[int], layers_per_group: int) -> int:
    return sum(cdiv(n, layers_per_group) for n in counts)


def choose_layers_per_group(counts: Sequence[int], blocks_per_request: Sequence[int]) -> int:
    """Slots per group for types of ``counts`` layers needing ``blocks_per_request`` each.

    Among sizes that make no more groups than the smallest type's count would (the
    vLLM rule), pick the one whose groups waste the fewest layer pages for one
    max_model_len request: sum over types of ceil(n / size) * size * blocks. Ties go
    to fewer groups, then to the smaller size. A single type gives one group.
    """
    bound = _num_groups(counts, min(counts))

    def cost(size: int) -> tuple[int, int, int]:
        pages = sum(cdiv(n, size) * size * b for n, b in zip(counts, blocks_per_request, strict=True))
        return pages, _num_groups(counts, size), size

    candidates = [s for s in range(1, max(counts) + 1) if _num_groups(counts, s) <= bound]
    return min(candidates, key=cost)


def plan_kv_cache(
    layer_specs: Mapping[str, KVCacheSpec],
    memory_bytes: int,
    *,
    max_model_len: int,
    options: PlanOptions | None = None,
) -> KVCacheConfig:
    """Plan groups, block sizes, layout and num_blocks for a byte budget.

    ``memory_bytes`` is the budget of the whole cache (all tensor-parallel devices
    together: the plan is the same for any ``tensor_parallel``, each device holding
    1 / ``tensor_parallel`` of the attention bytes and a replicated copy of a state
    pool) and ``max_model_len`` the longest request it must serve alone. How to plan
    is ``options`` (:class:`PlanOptions`; None: ``PlanOptions()``, whose state layout
    is picked for the model by :func:`default_state_layout`). Each state layout has
    its planner, and all share one attention step (:func:`_paged_groups`):
    :func:`_plan_attention_pages` (vLLM's rule), :func:`_plan_state_pool` and
    :func:`_plan_shared_pages`.

    Raises :class:`PlanError` for bad arguments, :class:`IncompatibleSpecsError` when
    pages cannot be unified, :class:`InsufficientMemoryError` when the budget (or
    ``num_blocks_override``) cannot hold one request of ``max_model_len`` tokens, and
    :class:`TensorParallelError` when a group's KV heads do not split into whole heads
    per device.
    """
    if not isinstance(layer_specs, Mapping) or not layer_specs:
        raise PlanError(f"layer_specs must be a non-empty mapping, got {layer_specs!r}")
    _positive_int("memory_bytes", memory_bytes)
    _positive_int("max_model_len", max_model_len)
    options = PlanOptions() if options is None else options
    if not isinstance(options, PlanOptions):
        raise PlanError(f"options must be a PlanOptions or None, got {options!r}")
    state_layout = options.state_layout_for(layer_specs)
    if state_layout != "attention_pages" and options.num_blocks_override is not None:
        raise PlanError(
            f"num_blocks_override={options.num_blocks_override} cannot be combined with "
            f"state_layout={state_layout!r}, which places attention blocks and states in memory_bytes itself"
        )
    padded = {name: pad_head_size(spec, options.tile) for name, spec in layer_specs.items()}
    planner = _LAYOUT_PLANNERS[state_layout]
    config = planner(_layer_types(padded), _Budget(layer_specs, padded, memory_bytes, max_model_len, options))
    return dataclasses.replace(config, tensor_parallel=options.tensor_parallel)


@dataclass(frozen=True)
class _Budget:
    """What every layout planner plans for: the specs (as given and tile-padded), the
    bytes, the longest request and the options."""

    original: Mapping[str, KVCacheSpec]
    padded: Mapping[str, KVCacheSpec]
    memory_bytes: int
    max_model_len: int
    options: PlanOptions

    def blocks_per_request(self, groups: Sequence[KVCacheGroup], state_unit: int | None = None) -> int:
        """Blocks one max_model_len request holds in ``groups``, all together (:func:`held_blocks`)."""
        return sum(held_blocks(groups, state_unit, self.max_model_len, self.options.step_tokens))

    def config(
        self,
        num_blocks: int,
        groups: tuple[KVCacheGroup, ...],
        pages: BlockPages | None,
        states: StatePool | SharedStates | None = None,
    ) -> KVCacheConfig:
        """The plan, with what every layout sets alike."""
        return KVCacheConfig(
            num_blocks=num_blocks,
            groups=groups,
            pages=pages,
            max_model_len=self.max_model_len,
            memory_bytes=self.memory_bytes,
            max_num_batched_tokens=self.options.step_tokens,
            head_dim_multiple=self.options.tile,
            states=states,
        )


@dataclass(frozen=True)
class _PagedGroups:
    """The attention step every layout shares: types cut into groups of equal layer
    count, with block sizes that make their pages equal, laid on the pages."""

    groups: tuple[KVCacheGroup, ...]
    pages: BlockPages
    blocks_per_request: int
    """Blocks one max_model_len request holds in these groups, all together."""

    @property
    def hash_block_size(self) -> int:
        """The smallest block size of these groups."""
        return min(g.block_size for g in self.groups)


def _paged_groups(types: Sequence[_LayerType], budget: _Budget) -> _PagedGroups:
    """Group ``types`` (attention types; vLLM's rule passes the Mamba types too, padded
    to the page), size their blocks and pages, count one request's blocks."""
    options = budget.options
    sizes, page = _unify_pages([t.spec for t in types], options.block_size)
    per_type = [
        t.spec.blocks_per_request(budget.max_model_len, size, options.step_tokens)
        for t, size in zip(types, sizes, strict=True)
    ]
    per_group = choose_layers_per_group([len(t.layer_names) for t in types], per_type)
    groups = tuple(
        KVCacheGroup(names, t.spec, size, _head_padding_bytes_per_token(names, budget.original, budget.padded))
        for t, size in zip(types, sizes, strict=True)
        for names in _strided(t.layer_names, cdiv(len(t.layer_names), per_group))
    )
    pages = BlockPages(
        layout=options.layout,
        layers=tuple(
            tuple(g.layer_names[i] if i < len(g.layer_names) else None for g in groups) for i in range(per_group)
        ),
        page_size_bytes=page,
    )
    return _PagedGroups(groups, pages, budget.blocks_per_request(groups))


def _strided(names: Sequence[str], num_groups: int) -> list[tuple[str, ...]]:
    """``names`` dealt round-robin into ``num_groups`` groups (vLLM's rule): with
    pipeline stages holding consecutive layers, every stage then holds a share of every
    group instead of whole groups of one type, so no stage pads a group out."""
    return [tuple(names[i::num_groups]) for i in range(num_groups)]


def _plan_attention_pages(types: Sequence[_LayerType], budget: _Budget) -> KVCacheConfig:
    """The ``state_layout="attention_pages"`` plan (vLLM's rule): every type on the
    pages, a Mamba state padded up to one page, ``memory_bytes // block_bytes`` blocks
    (or ``num_blocks_override``)."""
    paged = _paged_groups(types, budget)
    block_bytes = paged.pages.block_bytes
    override = budget.options.num_blocks_override
    num_blocks = budget.memory_bytes // block_bytes if override is None else override
    needed = paged.blocks_per_request + 1
    if num_blocks * block_bytes > budget.memory_bytes:
        raise InsufficientMemoryError(
            f"num_blocks_override={num_blocks} needs {num_blocks * block_bytes} B "
            f"({num_blocks} x {block_bytes} B blocks) > memory_bytes={budget.memory_bytes}"
        )
    if num_blocks < needed:
        raise InsufficientMemoryError(
            f"memory_bytes={budget.memory_bytes} holds {num_blocks} blocks of {block_bytes} B, but one "
            f"request of max_model_len={budget.max_model_len} needs {needed} blocks with the null "
            f"block: the smallest budget that fits is {exact_bytes(needed * block_bytes)}"
        )
    return budget.config(num_blocks, paged.groups, paged.pages)


def _split_recurrent(types: Sequence[_LayerType]) -> tuple[list[_LayerType], list[_LayerType]]:
    """(attention types, recurrent types), for the layouts that keep states off vLLM's pages."""
    return [t for t in types if not isinstance(t.spec, MambaSpec)], [t for t in types if isinstance(t.spec, MambaSpec)]


def _labels(types: Sequence[_LayerType]) -> str:
    return ", ".join(sorted({t.spec.label for t in types}))


def _with_state_groups(
    types: Sequence[_LayerType], attention_groups: Sequence[KVCacheGroup], hash_block_size: int
) -> tuple[KVCacheGroup, ...]:
    """All groups in type order: each recurrent type one group at ``hash_block_size``,
    each attention type its paged groups."""
    return tuple(
        g
        for t in types
        for g in (
            [KVCacheGroup(t.layer_names, t.spec, hash_block_size)]
            if isinstance(t.spec, MambaSpec)
            else [g for g in attention_groups if g.spec.type_key == t.spec.type_key]
        )
    )


def _state_row_bytes(recurrent: Sequence[_LayerType]) -> int:
    """Bytes of one state row: the states of the largest recurrent group's layers."""
    return max(len(t.layer_names) * _state_bytes(t.spec) for t in recurrent)


def _plan_state_pool(types: Sequence[_LayerType], budget: _Budget) -> KVCacheConfig:
    """The ``state_layout="state_pool"`` plan: attention pages without the states, states in rows.

    Attention types are planned as if the Mamba layers were absent (their block sizes
    stay near ``block_size``). Each Mamba type is one group at the hash block size;
    its blocks are rows of a :class:`StatePool`; a row holds all the group's layers'
    states for one request (the largest group sets the row size).

    Live states are one per running request and recurrent group: ``max_num_seqs``
    requests' worth when given (:class:`StatePoolOptions`), else the most requests n
    for which n live states plus the attention blocks of n max_model_len requests
    (plus the null block and null state) fit in ``memory_bytes - checkpoint_bytes``,
    which balances the two pools. ``checkpoint_bytes // row_bytes`` more states hold
    prefix-cache checkpoints; the attention pool gets every byte left. A model with
    no attention layers gets no pages and ``num_blocks=1`` (the null block alone).
    """
    attention, recurrent = _split_recurrent(types)
    if not recurrent:
        raise PlanError(
            "state_layout='state_pool' needs recurrent (MambaSpec) layers, but every layer is attention: "
            f"{_labels(types)}"
        )
    sizes = budget.options.state_pool or StatePoolOptions()
    max_num_seqs, checkpoint_bytes, memory_bytes = sizes.max_num_seqs, sizes.checkpoint_bytes, budget.memory_bytes
    paged = _paged_groups(attention, budget) if attention else None
    pages = paged.pages if paged is not None else None
    block_bytes = pages.block_bytes if pages is not None else 0
    need = paged.blocks_per_request if paged is not None else 0
    hash_block_size = paged.hash_block_size if paged is not None else budget.options.block_size
    row_bytes = _state_row_bytes(recurrent)
    groups = _with_state_groups(types, paged.groups if paged is not None else (), hash_block_size)
    states_per_request = budget.blocks_per_request([g for g in groups if isinstance(g.spec, MambaSpec)], 1)
    per_request = need * block_bytes + states_per_request * row_bytes
    fixed = block_bytes + row_bytes  # the null block and the null state
    num_seqs = (memory_bytes - checkpoint_bytes - fixed) // per_request if max_num_seqs is None else max_num_seqs
    live = num_seqs * states_per_request
    num_states = 1 + live + checkpoint_bytes // row_bytes
    num_blocks = (memory_bytes - num_states * row_bytes) // block_bytes if attention else 1
    fits = num_states * row_bytes + num_blocks * block_bytes <= memory_bytes
    if num_seqs < 1 or num_blocks < need + 1 or not fits:
        if max_num_seqs is None:  # one request, the checkpoint bytes, the null block and state
            smallest = checkpoint_bytes + fixed + per_request
        else:
            states = 1 + max_num_seqs * states_per_request + checkpoint_bytes // row_bytes
            smallest = states * row_bytes + ((need + 1) * block_bytes if attention else 0)
        raise InsufficientMemoryError(
            f"memory_bytes={memory_bytes} with checkpoint_bytes={checkpoint_bytes} and "
            f"max_num_seqs={max_num_seqs} cannot hold {max(num_seqs, 1)} request(s) of "
            f"max_model_len={budget.max_model_len}: each needs {need} attention blocks of {block_bytes} B and "
            f"{states_per_request} state row(s) of {row_bytes} B, plus the null block and null state; "
            f"the smallest budget that fits is {exact_bytes(smallest)}"
        )
    pool = StatePool(num_states=num_states, state_bytes=row_bytes, num_live_states=live)
    return budget.config(num_blocks, groups, pages, pool)


def _plan_shared_pages(types: Sequence[_LayerType], budget: _Budget) -> KVCacheConfig:
    """The ``state_layout="shared_pages"`` plan: one pool of attention blocks; a state is pages of it.

    Attention types are planned as if the Mamba layers were absent (as for the state
    pool); each Mamba type is one group at the hash block size whose state (all its
    layers, one request) takes ``ceil(state bytes / block bytes)`` blocks. Every byte
    goes to one pool: nothing is split at plan time. A model with no attention layers
    is refused (use ``state_pool``: there are no pages to share).
    """
    attention, recurrent = _split_recurrent(types)
    if not recurrent or not attention:
        raise PlanError(
            f"state_layout='shared_pages' needs recurrent (MambaSpec) and attention layers, got {_labels(types)} "
            "(recurrent layers alone: use 'state_pool')"
        )
    row_bytes = _state_row_bytes(recurrent)
    paged = _paged_groups(attention, budget)
    block_bytes = paged.pages.block_bytes
    shared = SharedStates(pages_per_state=cdiv(row_bytes, block_bytes), state_bytes=row_bytes)
    groups = _with_state_groups(types, paged.groups, paged.hash_block_size)
    num_blocks = budget.memory_bytes // block_bytes
    need = budget.blocks_per_request(groups, shared.pages_per_state)
    if num_blocks < need + 1:
        raise InsufficientMemoryError(
            f"memory_bytes={budget.memory_bytes} holds {num_blocks} blocks of {block_bytes} B, but one request of "
            f"max_model_len={budget.max_model_len} needs {need} blocks ({len(recurrent)} live state(s) of "
            f"{shared.pages_per_state} block(s) included) with the null block: the smallest budget that fits "
            f"is {exact_bytes((need + 1) * block_bytes)}"
        )
    return budget.config(num_blocks, groups, paged.pages, shared)


_LAYOUT_PLANNERS: dict[StateLayout, Callable[[Sequence[_LayerType], _Budget], KVCacheConfig]] = {
    "attention_pages": _plan_attention_pages,
    "state_pool": _plan_state_pool,
    "shared_pages": _plan_shared_pages,
}
"""The planner of each state layout."""


def exact_concurrency_bound(layer_specs: Mapping[str, KVCacheSpec], memory_bytes: int, max_model_len: int) -> int:
    """How many max_model_len requests the exact bytes allow: no pages, blocks or padding.

    floor(memory_bytes / (attention bytes per token x max_model_len + one live state)),
    where the attention bytes per token sum every non-Mamba layer's ``bytes_per_token``
    and the live state sums every Mamba layer's ``state_bytes``. It is the yardstick
    the planner's concurrency is measured against (the target: >= 98% of it).
    """
    if not isinstance(layer_specs, Mapping) or not layer_specs:
        raise PlanError(f"layer_specs must be a non-empty mapping, got {layer_specs!r}")
    _positive_int("memory_bytes", memory_bytes)
    _positive_int("max_model_len", max_model_len)
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise PlanError(f"layer {name!r} has no KVCacheSpec: {spec!r}")
    state = sum(s.state_bytes for s in layer_specs.values() if isinstance(s, MambaSpec))
    per_token = sum(_bytes_per_token(s) for s in layer_specs.values() if not isinstance(s, MambaSpec))
    return memory_bytes // (per_token * max_model_len + state)
