"""State-aware KV events: what a hybrid model announces as cached is what a hit can use.

A model with recurrent layers (Mamba, Gated DeltaNet) resumes a prompt only where every
recurrent group holds a state checkpoint and every attention group holds the blocks
before it. Its manager records per-group events: attention blocks stored and removed,
and state checkpoints stored and removed under the same chained hashes. A KV-event
router that credits every attention block it hears of credits prefixes the engine then
recomputes (no state there). :class:`StateAwareEvents` turns the per-group stream into
one stream a router can take at its word:

- an attention block is **published** (``BlockStored``) once the whole chain from the
  first block to it is cached in every attention group and the chain goes on, through
  cached attention blocks, to a block where every recurrent group holds a checkpoint
  (the block itself or a later one): a prompt that follows the chain that far resumes
  there;
- it is **withdrawn** (``BlockRemoved``) when that stops being true: the checkpoint is
  evicted and no later one remains, or an attention block on the way is evicted;
- stores name their parent, which is always published before them (a router's radix
  tree hangs a block under its parent), so replaying the output stream from its start
  rebuilds exactly the published set; a hash is announced once whatever the number of
  copies the pools hold, and withdrawn once the last goes.

The output is one chain of the reference group (the first attention group at the hash
block size), marked with no group (``group=None``: a router reads it as a single-group
model). Other attention groups at that block size must hold the chain too; groups at a
coarser block size are not consulted (no model here has one besides its states).
A prompt that leaves a published chain between two checkpoints is credited past the
earlier one: the router's prefix match cannot know where the engine resumes inside a
chain.

Two rules narrow that down; :meth:`StateAwareEvents.for_config` builds both. Each makes
a block without a checkpoint of its own *good* only in some cases; a block is published
when every block of its chain is good (and it reaches a checkpoint):

- ``dead_branches``: each of its cached children reaches a checkpoint through cached
  blocks and is good. A cached branch that reaches no checkpoint (a chat whose own
  checkpoint was evicted while its attention blocks stay, the common case in a small
  state pool) would otherwise leave the block published by another branch's deeper
  checkpoint, and the chat's next turn, following its own branch, would be credited the
  shared prefix and recompute it (the router's credit ends at the last published block,
  the engine resumes at the last checkpoint before it). With this rule a prompt that
  follows cached blocks is credited only what it hits; only one leaving the cached
  tree can be credited past where it resumes.
- ``branch_points``: exactly one of its children reaches a checkpoint through cached
  blocks, and that child is good. A block where such branches split is published only
  with its own checkpoint, so a prompt leaving the cached tree there (a chat whose own
  chain was evicted) resumes where it is credited; the first divergence from a single
  chain is still credited past the last checkpoint.

The host tier (CPU offloading) is announced by :class:`HostTierEvents`: the chains a hit
can use with the host tier's help, as the connector serves one (the device hit, then
host blocks up to a checkpoint on host), under the branch-point rule (where the device
resumes counts as a checkpoint) and the device transform's dead-branch rule. Host keys
name no parent: the chain comes from the device stores, and the links of blocks that
left the device are kept a while (the last :data:`FORGOTTEN_LINKS`) for the host's
store of them, which completes after the device has freed them. Pure host code: no
JAX, no sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jaxkv.core.pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.offload.catalog import KeysStored, OffloadEvent
from jaxkv.planner import KVCacheConfig
from jaxkv.specs import MambaSpec

FORGOTTEN_LINKS = 1 << 16
"""How many links (parent, tokens) of blocks no tier holds any more are remembered, for a host store completing late."""

_Link = tuple[bytes | None, int, tuple[int, ...], str | None]


@dataclass(eq=False)
class _Block:
    """One hash of the reference chain, as far as the events told of it."""

    parent: bytes | None = None
    linked: bool = False
    """Whether a reference-group store named its parent (a state event alone does not)."""
    block_size: int = 0
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None
    children: set[bytes] = field(default_factory=set)
    attention: list[int] = field(default_factory=list)
    """Copies cached per attention group (the reference group first)."""
    states: list[int] = field(default_factory=list)
    """Checkpoints cached per recurrent group."""
    elsewhere: bool = False
    """Whether a hit ends here through another tier (its owner says so: the device resumes here)."""
    sub: int = 0
    """Checkpoints reachable below it: the children's :attr:`below`, summed."""
    below: int = 0
    """Checkpoints reachable from it through cached attention blocks, itself included (0 if not cached)."""
    cached: int = 0
    """Children cached in every attention group (:attr:`present`)."""
    counted_present: bool = False
    """Whether its parent's :attr:`cached` counts it."""
    live: int = 0
    """Children whose :attr:`below` is positive."""
    usable_live: int = 0
    """Of those, the usable ones."""
    usable: bool = False
    """Whether its chain may run on through it: cached, and good under the rules in force."""

    @property
    def present(self) -> bool:
        return all(self.attention)

    @property
    def checkpoint(self) -> bool:
        return self.elsewhere or all(self.states)


class StateAwareEvents:
    """Turns a hybrid manager's per-group events into the blocks a hit can use (see the module doc).

    ``attention_groups``: the groups whose blocks a hit needs along the whole chain, the
    reference group (the one published) first; ``state_groups``: those that need a
    checkpoint where the hit ends; ``branch_points``: whether a block where cached
    branches split is published only with its own checkpoint; ``dead_branches``: whether a
    block with a cached branch that reaches no checkpoint is published only with its own
    checkpoint (see the module doc; :meth:`for_config` sets both).
    """

    def __init__(
        self,
        attention_groups: Sequence[int],
        state_groups: Sequence[int],
        *,
        branch_points: bool = False,
        dead_branches: bool = False,
    ) -> None:
        if not attention_groups or not state_groups:
            raise ValueError(
                f"state-aware events need attention and state groups, got {attention_groups!r} and {state_groups!r}"
            )
        self.attention_groups = tuple(attention_groups)
        self.state_groups = tuple(state_groups)
        self.branch_points = branch_points
        self.dead_branches = dead_branches
        self._attention_index = {g: i for i, g in enumerate(self.attention_groups)}
        self._state_index = {g: i for i, g in enumerate(self.state_groups)}
        self._blocks: dict[bytes, _Block] = {}
        self._published: set[bytes] = set()
        self._gone: OrderedDict[bytes, _Link] = OrderedDict()

    @classmethod
    def for_config(cls, config: KVCacheConfig) -> StateAwareEvents | None:
        """The transform for a plan's groups, under the branch-point and dead-branch rules;
        None for a model without recurrent groups (its events are published as recorded)."""
        states = [i for i, g in enumerate(config.groups) if isinstance(g.spec, MambaSpec)]
        attention = [
            i
            for i, g in enumerate(config.groups)
            if not isinstance(g.spec, MambaSpec) and g.block_size == config.hash_block_size
        ]
        return cls(attention, states, branch_points=True, dead_branches=True) if states and attention else None

    # ------------------------------------------------------------------ queries
    def published(self) -> frozenset[bytes]:
        """The hashes announced as cached now."""
        return frozenset(self._published)

    def resumes_at(self, h: bytes) -> bool:
        """Whether a hit can end at ``h``: a checkpoint there in every recurrent group and
        its whole chain cached."""
        b = self._blocks.get(h)
        return b is not None and b.checkpoint and self._path(h)[1]

    # ------------------------------------------------------------- the transform
    def apply(self, events: Iterable[KVCacheEvent], host: Iterable[OffloadEvent] = ()) -> list[KVCacheEvent]:
        """The output events for one step's manager events, then its host catalogs' events
        (each key one more copy of its block in its group), in order."""
        out: list[KVCacheEvent] = []
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self._blocks.clear()
                self._published.clear()
                out.append(e)
            elif isinstance(e, BlockStored):
                self._stored(e, out)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._count(e.group, h, -1, out)
        for change in host:
            delta = 1 if isinstance(change, KeysStored) else -1
            for key, group in change.keys:
                assert isinstance(key, bytes)  # the offload connector keys its host tier by block hash
                self._count(group, key, delta, out)
        return out

    def _stored(self, e: BlockStored, out: list[KVCacheEvent]) -> None:
        if e.group == self.attention_groups[0]:
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                b = self._block(h)
                if not b.linked:
                    b.linked, b.parent, b.block_size, b.lora_name = True, parent, e.block_size, e.lora_name
                    b.token_ids = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    # what it adds to its parent, counted below by _count
                    b.below, b.usable, b.counted_present = 0, False, False
                    if parent is not None:
                        self._block(parent).children.add(h)
                parent = h
        for h in e.block_hashes:
            self._count(e.group, h, +1, out)

    def _new_block(self, h: bytes) -> _Block:
        b = self._blocks[h] = _Block(attention=[0] * len(self.attention_groups), states=[0] * len(self.state_groups))
        return b

    def _block(self, h: bytes) -> _Block:
        """``h``'s entry, made if needed with its link (and its ancestors') if remembered."""
        b = self._blocks.get(h)
        if b is not None:
            return b
        b = child = self._new_block(h)
        while (link := self._gone.pop(h, None)) is not None:
            child.linked = True
            child.parent, child.block_size, child.token_ids, child.lora_name = link
            if child.parent is None:
                break
            parent = self._blocks.get(child.parent)
            if parent is not None:
                parent.children.add(h)
                break
            parent = self._new_block(child.parent)
            parent.children.add(h)
            h, child = child.parent, parent
        return b

    def _count(self, group: int, h: bytes, delta: int, out: list[KVCacheEvent]) -> None:
        """One copy of ``h`` in ``group`` came (+1) or went (-1); announce what changed."""
        if group in self._attention_index:
            where, i = "attention", self._attention_index[group]
        elif group in self._state_index:
            where, i = "states", self._state_index[group]
        else:
            return
        b = self._blocks.get(h)
        if delta < 0 and (b is None or not getattr(b, where)[i]):
            return  # the removal of a copy never heard of (a stream followed from its middle)
        getattr(self._block(h), where)[i] += delta
        self._changed(h, out)

    def mark_elsewhere(self, h: bytes, resumes: bool) -> list[KVCacheEvent]:
        """Say whether a hit ends at ``h`` through another tier (a checkpoint of ``h`` this
        stream does not count); the output events for the change."""
        b = self._blocks.get(h)
        out: list[KVCacheEvent] = []
        if (b.elsewhere if b is not None else False) != resumes:
            self._block(h).elsewhere = resumes
            self._changed(h, out)
        return out

    def _changed(self, h: bytes, out: list[KVCacheEvent]) -> None:
        """``h``'s copies or checkpoints changed: recount, announce what changed, forget what is gone."""
        self._republish(h, self._update(h), out)
        self._forget(h)

    def _update(self, h: bytes) -> bytes | None:
        """Recount the checkpoints reachable from ``h`` and whether it is usable and, while
        that changes, from its ancestors; the highest block whose usability changed."""
        top = None
        while True:
            b = self._blocks[h]
            was_below, was_usable, was_present = b.below, b.usable, b.counted_present
            present = b.counted_present = b.present
            b.below = b.sub + b.checkpoint if present else 0
            b.usable = present and (
                b.checkpoint
                or (
                    (not self.branch_points or (b.live == 1 and b.usable_live == 1))
                    and (not self.dead_branches or b.cached == b.usable_live)
                )
            )
            if b.usable != was_usable:
                top = h
            unchanged = (b.below, b.usable, present) == (was_below, was_usable, was_present)
            if unchanged or not b.linked or b.parent is None:
                return top
            parent = self._blocks[b.parent]
            parent.cached += present - was_present
            parent.sub += b.below - was_below
            parent.live += (b.below > 0) - (was_below > 0)
            parent.usable_live += (b.below > 0 and b.usable) - (was_below > 0 and was_usable)
            h = b.parent

    def _path(self, h: bytes) -> tuple[list[bytes], bool]:
        """The chain from its first block to ``h``, and whether all of it is cached and linked."""
        path = [h]
        ok = True
        b = self._blocks[h]
        while True:
            ok = ok and b.present and b.linked
            if not b.linked or b.parent is None:
                break
            path.append(b.parent)
            b = self._blocks[b.parent]
        path.reverse()
        return path, ok

    def _republish(self, h: bytes, top: bytes | None, out: list[KVCacheEvent]) -> None:
        """Announce the changes on the chain to ``h`` and below ``top`` (a block on that
        chain whose usability changed, if any: the chain is walked down to it, then its
        subtree, which holds the rest of the chain)."""
        path, _ = self._path(h)
        prefix_ok = True
        for p in path:
            prefix_ok = prefix_ok and self._blocks[p].usable and self._blocks[p].linked
            self._set(p, prefix_ok and self._blocks[p].below > 0, out)
            if p == top:
                break
        if top is None:
            return
        stack = [(c, prefix_ok) for c in self._blocks[top].children]
        while stack:
            c, parent_ok = stack.pop()
            b = self._blocks[c]
            chain_ok = parent_ok and b.usable
            want = chain_ok and b.below > 0
            if want or c in self._published:
                self._set(c, want, out)
                stack.extend((g, chain_ok) for g in b.children)

    def _set(self, h: bytes, want: bool, out: list[KVCacheEvent]) -> None:
        if want == (h in self._published):
            return
        group = self.attention_groups[0]
        if want:
            self._published.add(h)
            b = self._blocks[h]
            _append_store(out, BlockStored(group, (h,), b.parent, b.block_size, b.token_ids, b.lora_name))
        else:
            self._published.discard(h)
            out.append(BlockRemoved(group, (h,)))

    def _forget(self, h: bytes) -> None:
        """Drop what is known of ``h`` (and of ancestors left empty) once nothing holds it."""
        while h in self._blocks:
            b = self._blocks[h]
            if any(b.attention) or any(b.states) or b.elsewhere or b.children or h in self._published:
                return
            del self._blocks[h]
            if b.linked:
                self._gone[h] = (b.parent, b.block_size, b.token_ids, b.lora_name)
                while len(self._gone) > FORGOTTEN_LINKS:
                    self._gone.popitem(last=False)
            if not b.linked or b.parent is None or b.parent not in self._blocks:
                return
            self._blocks[b.parent].children.discard(h)
            h = b.parent


class HostTierEvents:
    """What a hybrid announces for its host tier (medium ``"CPU"``): the chains a hit can
    use with the host tier's help, as one chain stream of the reference group.

    The connector serves a hit as the device hit, then host blocks after it up to a
    checkpoint on host. So a block is announced where the device alone resumes on its
    chain (the device transform's chains, given to :meth:`apply`), or where its chain is
    cached in the device or the host tier, block by block, and goes on through such blocks
    to a checkpoint the host holds or a block the device resumes at (a checkpoint there,
    its chain on device), under the branch-point rule: where cached branches split, the
    block needs such a checkpoint of its own (a prompt leaving there resumes there). The
    host's on-eviction store puts a hit's blocks on host together with its checkpoint, so
    the device blocks on the way are on host too (a host eviction of one of them alone is
    not seen here). The announced set holds the device chains, so a router that ignores
    the medium stays consistent.
    """

    def __init__(self, device: StateAwareEvents) -> None:
        self.device = device
        """The device transform, whose output :meth:`apply` is given."""
        self._chains = StateAwareEvents(
            device.attention_groups, device.state_groups, branch_points=True, dead_branches=device.dead_branches
        )
        self._refs: dict[bytes, int] = {}
        """Per hash announced, how many of the two sets hold it (device chains, host chains)."""

    def published(self) -> frozenset[bytes]:
        """The hashes announced as cached now."""
        return frozenset(self._refs)

    def apply(
        self, events: Sequence[KVCacheEvent], device_out: Sequence[KVCacheEvent], host: Iterable[OffloadEvent]
    ) -> list[KVCacheEvent]:
        """The output events for one step: its manager ``events``, the device transform's
        output for them ``device_out`` (:attr:`device` has applied them), and the host
        catalogs' events ``host``."""
        states = set(self._chains.state_groups)
        kv = [e for e in events if isinstance(e, AllBlocksCleared) or e.group not in states]
        chains = self._chains.apply(kv, host)
        # where the device resumes changes only with a device checkpoint or the device's chains
        touched = dict.fromkeys(
            h
            for e in (*(e for e in events if not isinstance(e, AllBlocksCleared) and e.group in states), *device_out)
            if not isinstance(e, AllBlocksCleared)
            for h in e.block_hashes
        )
        for h in touched:
            chains += self._chains.mark_elsewhere(h, self.device.resumes_at(h))
        out: list[KVCacheEvent] = []
        for e in (*device_out, *chains):
            if isinstance(e, AllBlocksCleared):
                self._refs.clear()
                out.append(e)
            elif isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self._refs[h] = self._refs.get(h, 0) + 1
                    if self._refs[h] == 1:
                        tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
                        _append_store(out, BlockStored(e.group, (h,), parent, e.block_size, tokens, e.lora_name))
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._refs[h] -= 1
                    if not self._refs[h]:
                        del self._refs[h]
                        out.append(BlockRemoved(e.group, (h,)))
        return out


def _append_store(out: list[KVCacheEvent], e: BlockStored) -> None:
    """Append a one-block store, joined to the run before it when it continues it."""
    last = out[-1] if out else None
    if (
        isinstance(last, BlockStored)
        and last.block_hashes[-1] == e.parent_block_hash
        and last.lora_name == e.lora_name
        and last.group == e.group
    ):
        out[-1] = BlockStored(
            e.group,
            (*last.block_hashes, *e.block_hashes),
            last.parent_block_hash,
            e.block_size,
            last.token_ids + e.token_ids,
            e.lora_name,
        )
    else:
        out.append(e)
