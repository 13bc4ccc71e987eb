"""Where a recurrent request's prefill caches its state, and how a chunk ends on one.

A recurrent state exists only where a step ends, so it can be cached only there. With
state groups (the planner's ``state_pool`` layout or shared pages) that is at *checkpoint
positions* of the prompt (a block boundary each), where a scheduler ends its prefill
chunks (:class:`CheckpointPolicy`). In vLLM's layout (``attention_pages``) every block
boundary can hold a state, and chunks end as vLLM's scheduler ends them in align mode
(:class:`AlignedChunks`). Pure integer arithmetic: the manager passes each request's numbers in.
"""

from __future__ import annotations

import math
from collections import deque

from jaxkv.core.manager_errors import KVCacheManagerError
from jaxkv.ints import is_int
from jaxkv.planner import KVCacheConfig, SharedStates, StatePool
from jaxkv.specs import MambaSpec


def resend_position(num_prompt_tokens: int, block_size: int) -> int:
    """The last block boundary before a prompt's last token: where the same prompt sent
    again resumes (a hit leaves at least the last token to compute)."""
    return (num_prompt_tokens - 1) // block_size * block_size


BRANCH_DEPTHS = (1024, 256, 2048)
"""Tokens back from a prompt's end where its branch-ahead checkpoints sit, most likely
first: a later request sharing all but its last 1-2k tokens finds a state there (the
suffixes and tails of issue 39's workloads; vLLM's align mode checkpoints every block,
~1k tokens, and wins those hits), and one sharing all but its last 256 finds one 768
tokens nearer its branch. A prompt no longer than the first depth (a chat turn) places none
of these: a guess 256 back sat inside chats' system prompts, and hits passing through kept
those dead states warm (chat at vLLM's minimum memory 0.731 -> 0.724); one that starts a
chain places one :data:`SHORT_DEPTH` back instead."""

SHORT_DEPTH = 128
"""Tokens back from the end of a prompt no longer than the first branch depth where it places
its one guess, only when it starts a chain (a system prompt and a short query, the first of a
tenant's chats): the second prompt on that system prompt resumes there instead of computing
it all (short_behind_prefix, queries of 16-96 tokens: 0.980 -> 0.996 of attention-only). Only
hits that end on it keep it warm (:meth:`CheckpointPolicy.unwarmed`): one inside a chat's
first message, passed through by each later turn, held a dead state's bytes (chat at vLLM's
minimum memory 0.731 -> 0.727)."""

START_GUESSES = 2
"""Branch-ahead checkpoints a prompt that starts a chain places at least (a branching one:
one). Its chain is the one later prompts branch off (the first of a pair); a branching
prompt's guesses serve only a third. With one guess 1,024 back, a suffix of 16-1,024 tokens
after a 1-4k prefix loses ~800 tokens per hit; the second, 256 back, halves that for the
suffixes it covers."""

BRANCH_SHARE = 0.25
"""The share of the states memory holds that the running requests' branch-ahead
checkpoints may take together (each request gets its part at admission, and at least
the most likely depths (:data:`START_GUESSES`): at vLLM's minimum memory the share rounds
to none per request, and there the guesses are what the second request of a shared prefix hits)."""

DIVERGENCE_WINDOW = 32
"""How many recent admissions the policy learns whether prompts branch from."""

RESUME_MIN_OBSERVED = 8
RESUME_SHARE = 1 / 8
"""A running request's newest continuation is kept warm unless at least
:data:`RESUME_MIN_OBSERVED` of the recent admissions matched a cached chain and fewer than
this share of them extended one at its end (see :meth:`CheckpointPolicy.continuations_resumed`)."""


def num_states(config: KVCacheConfig) -> int:
    """How many recurrent states (one group's row) the plan's memory holds, 0 without state groups."""
    states = config.states
    if isinstance(states, StatePool):
        return states.num_states - 1
    if isinstance(states, SharedStates):
        return config.num_blocks // states.pages_per_state
    return 0


class CheckpointPolicy:
    """The checkpoint positions of a request's prompt, for one manager's config.

    A prompt of ``num_prompt_tokens`` tokens, found cached by full attention alone up
    to ``reach`` tokens (further than the whole hit when a state was missing there and
    a cached chain branches there: :class:`~jaxkv.core.coordinator.PrefixHit`), checkpoints
    its last block boundary before its last token (:func:`resend_position`: the longest
    hit the same prompt sent again can have), its last block boundary (where a next turn
    that extends it resumes), the boundary at ``reach`` (so the next request sharing
    that prefix finds a state there), every ``interval`` tokens if set, and with
    ``branch_ahead`` (on by default) its branch-ahead positions (:meth:`ahead`), placed
    before any branch is seen, so the second request of a shared prefix can hit too.

    Whether to place them is learned: only while at least half of the last
    :data:`DIVERGENCE_WINDOW` admissions that matched part of their prompt (:meth:`observe`)
    left a cached chain that goes on (requests branch off shared prefixes) rather than
    extended one at its end (chat turns, which resume from their newest state: there a
    guess costs a whole state and serves no one). How many is sized by memory: the
    running requests share :data:`BRANCH_SHARE` of the states the plan holds.
    """

    __slots__ = (
        "_diverged",
        "_extended",
        "block_size",
        "branch_ahead",
        "branch_budget",
        "enable_caching",
        "interval",
    )

    def __init__(
        self, config: KVCacheConfig, interval: int | None, *, enable_caching: bool, branch_ahead: bool = True
    ) -> None:
        """Refuse an ``interval`` that is not a positive multiple of the hash block size."""
        if interval is not None and (not is_int(interval) or interval <= 0 or interval % config.hash_block_size):
            raise KVCacheManagerError(
                f"checkpoint_interval must be a positive multiple of the hash block size "
                f"{config.hash_block_size}, got {interval!r}"
            )
        # Block size of the state groups (the hash block size), 0 without: no checkpoints.
        self.block_size = config.hash_block_size if config.state_group_ids else 0
        self.interval = interval
        self.enable_caching = enable_caching
        self.branch_ahead = branch_ahead
        # States the running requests' branch-ahead checkpoints may hold together.
        self.branch_budget = int(BRANCH_SHARE * num_states(config))
        self._diverged: deque[bool] = deque(maxlen=DIVERGENCE_WINDOW)
        self._extended: deque[bool] = deque(maxlen=DIVERGENCE_WINDOW)

    def observe(self, diverged: bool | None, extends: bool | None = None) -> None:
        """An admitted prompt ``diverged`` from a cached chain that goes on (True),
        extended one (False) or matched none (None): learn how often prompts branch; and
        whether full attention alone found it ``extends`` a cached chain at its end (a chat
        turn resuming the previous one: None when it matched none), to learn whether
        continuations are resumed."""
        if diverged is not None:
            self._diverged.append(diverged)
        if extends is not None:
            self._extended.append(extends)

    def continuations_resumed(self) -> bool:
        """Whether a request admitted now keeps its newest continuation checkpoint warm while
        it runs (a later turn resumes from where it ended): yes unless at least
        :data:`RESUME_MIN_OBSERVED` recent admissions matched a cached chain and fewer than
        :data:`RESUME_SHARE` of them extended one at its end (requests branch off shared
        prefixes and no turn follows: there the newest state of every running request, kept
        warm, holds a state's bytes each that the prefixes they share need)."""
        extended = self._extended
        return len(extended) < RESUME_MIN_OBSERVED or sum(extended) >= RESUME_SHARE * len(extended)

    def ahead(self, num_prompt_tokens: int, hit: int, reach: int, matched: int, num_running: int) -> tuple[int, ...]:
        """The branch-ahead positions of a prompt (block boundaries, in order; empty for
        none): :data:`BRANCH_DEPTHS` back from its end, past ``reach`` (a request that
        found its branch checkpoints it at ``reach``), as many as its share of the
        budget with ``num_running`` other requests running, and at least
        :data:`START_GUESSES` for a prompt that starts a chain, one for one that branches;
        for a prompt no longer than the first depth, one :data:`SHORT_DEPTH` back when it
        starts a chain and none otherwise. Only for a prompt that starts a chain (full
        attention alone ``matched`` nothing) or branches off one (``reach`` past the
        ``hit``); not for one that extends a cached chain (a chat turn, whose next turn
        resumes from its newest state)."""
        bs = self.block_size
        if (
            not bs
            or not self.enable_caching
            or not self.branch_ahead
            or (matched and reach == hit)
            or (matched and num_prompt_tokens <= BRANCH_DEPTHS[0])
        ):
            return ()
        if 2 * sum(self._diverged) < len(self._diverged):
            return ()
        if num_prompt_tokens <= BRANCH_DEPTHS[0]:
            depths: tuple[int, ...] = (SHORT_DEPTH,)
        else:
            count = max(1 if matched else START_GUESSES, self.branch_budget // (num_running + 1))
            depths = BRANCH_DEPTHS[:count]
        positions = ((num_prompt_tokens - d) // bs * bs for d in depths)
        return tuple(sorted({p for p in positions if p > reach}))

    def unwarmed(self, num_prompt_tokens: int, ahead: tuple[int, ...]) -> tuple[int, ...]:
        """The branch-ahead positions ``ahead`` of a prompt that a hit passing through does
        not keep warm unless one ended there before: a short prompt's (:data:`SHORT_DEPTH`).
        A long prompt's stay as warm as the prefix they sit in: treating them alike cost
        forks at vLLM's minimum memory 0.989 -> 0.964 of attention-only and prefix_once at
        2x 0.644 -> 0.625 (issue 39's workloads, seed 0)."""
        return ahead if num_prompt_tokens <= BRANCH_DEPTHS[0] else ()

    def branch_positions(self, branch_points: tuple[int, ...], hit: int) -> tuple[int, ...]:
        """The block boundaries at or below a prompt's ``branch_points`` past its ``hit``
        (in order): where the caller expects later prompts to leave this one (a chat's
        message boundaries), so a state waits there before any branch is seen. Not learned
        and not budgeted like :meth:`ahead`, and in its place: the caller names few and
        knows where its prompts branch (a guess beside them holds a state's bytes that
        the named ones need), and a later request that shares the prefix finds the state
        and places none."""
        bs = self.block_size
        if not bs or not self.enable_caching:
            return ()
        return tuple(sorted({p // bs * bs for p in branch_points if p // bs * bs > hit}))

    def shared(
        self, num_prompt_tokens: int, reach: int, num_computed_tokens: int, ahead: tuple[int, ...] = ()
    ) -> set[int]:
        """The positions past ``num_computed_tokens`` that other requests are expected to
        hit: ``reach``'s block boundary, the branch-ahead positions ``ahead`` and every
        ``interval`` (not the prompt's end)."""
        bs = self.block_size
        prompt_end = num_prompt_tokens // bs * bs
        positions = {reach // bs * bs, *ahead}
        if self.interval:
            positions.update(range(self.interval, prompt_end, self.interval))
        return {p for p in positions if num_computed_tokens < p <= prompt_end}

    def positions(
        self, num_prompt_tokens: int, reach: int, num_computed_tokens: int, ahead: tuple[int, ...] = ()
    ) -> tuple[int, ...]:
        """Every checkpoint position past ``num_computed_tokens``, in order (none without
        state groups or without caching)."""
        bs = self.block_size
        if not bs or not self.enable_caching:
            return ()
        positions = self.shared(num_prompt_tokens, reach, num_computed_tokens, ahead)
        positions.update((resend_position(num_prompt_tokens, bs), num_prompt_tokens // bs * bs))
        return tuple(sorted(p for p in positions if p > num_computed_tokens))

    def chunk_limit(
        self, num_prompt_tokens: int, reach: int, start: int, num_new_tokens: int, ahead: tuple[int, ...] = ()
    ) -> int:
        """``num_new_tokens`` cut so a chunk starting at ``start`` ends at the next
        checkpoint position, if one falls inside it; unchanged without state groups."""
        if num_new_tokens > 1:
            positions = self.positions(num_prompt_tokens, reach, start, ahead)
            if positions and positions[0] < start + num_new_tokens:
                return positions[0] - start
        return num_new_tokens


class AlignedChunks:
    """Prefill chunk ends of a recurrent model in vLLM's layout, as vLLM's scheduler cuts
    them in align mode (so the states the manager caches sit where vLLM's do).

    A chunk that does not finish the prefill ends on a block boundary (or schedules
    nothing, unless a block is wider than ``max_num_batched_tokens``), and no chunk runs
    past the last boundary before the request's last token, past the next boundary when
    it starts mid-block, or past the boundary below ``reach`` when full attention alone
    matched further than the hit (the junction another request shares).
    """

    __slots__ = ("block_size", "max_chunk")

    def __init__(self, config: KVCacheConfig) -> None:
        recurrent = any(isinstance(g.spec, MambaSpec) for g in config.groups) and not config.state_group_ids
        # 0: no recurrent group in vLLM's layout, chunks are not cut
        self.block_size = math.lcm(*(g.block_size for g in config.groups)) if recurrent else 0
        self.max_chunk = config.max_num_batched_tokens

    def chunk_limit(
        self,
        num_prompt_tokens: int,
        num_tokens: int,
        reach: int,
        start: int,
        num_new_tokens: int,
        max_chunk_tokens: int | None = None,
    ) -> int:
        """``num_new_tokens`` cut as vLLM cuts a chunk starting at ``start``; 0: none this step.
        ``max_chunk_tokens``: the most a step schedules (the scheduler's budget; default the plan's)."""
        bs = self.block_size
        max_chunk = self.max_chunk if max_chunk_tokens is None else max_chunk_tokens
        prefill_end = max(num_prompt_tokens, num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        end = start + num_new_tokens
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= max_chunk:
                end = aligned
        stops = [(num_tokens - 1) // bs * bs]
        if start % bs:
            stops.append((start // bs + 1) * bs)
        if start < reach < end:
            stops.append(start + (reach - start) // bs * bs)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)
