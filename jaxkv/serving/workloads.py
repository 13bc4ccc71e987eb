"""Synthetic prompts for the serving demo and benchmarks: batches with shared prefixes +
unique tails, and multi-tenant multi-turn conversations (for routing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int, check_int_range


class WorkloadError(JaxkvError, ValueError):
    """A workload knob out of range."""


def shared_prefix_prompts(
    *,
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[list[int]]:
    """``num_requests`` prompts: request i is prefix ``i % num_prefixes`` + a unique random tail.

    Prefixes are ``prefix_len`` random tokens (like system prompts); tail lengths are
    drawn uniformly from ``suffix_len = (lo, hi)``, both inclusive, ``lo >= 1``. A bad
    knob raises :class:`WorkloadError` naming it and its value.
    """
    for name, value, minimum in (
        ("num_requests", num_requests, 1),
        ("num_prefixes", num_prefixes, 1),
        ("prefix_len", prefix_len, 0),
        ("vocab_size", vocab_size, 1),
        ("seed", seed, 0),
    ):
        check_int(name, value, minimum=minimum, error=WorkloadError)
    lo, hi = check_int_range("suffix_len", suffix_len, error=WorkloadError)
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + rng.integers(0, vocab_size, int(rng.integers(lo, hi + 1))).tolist()
        for i in range(num_requests)
    ]


@dataclass(frozen=True)
class Conversation:
    """One user's chat with a tenant: the tenant's system prompt, then a user message per
    turn. A turn's prompt is the whole chat so far (:meth:`prompt`), so a follow-up
    starts with its previous turn's prompt and output."""

    tenant: int
    system_prompt: tuple[int, ...]
    user_messages: tuple[tuple[int, ...], ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def prompt(self, turn: int, previous_prompt: Sequence[int] = (), previous_output: Sequence[int] = ()) -> list[int]:
        """Turn ``turn``'s prompt: the system prompt and first message, or the previous
        turn's prompt + its output + this turn's message."""
        if turn == 0:
            return [*self.system_prompt, *self.user_messages[0]]
        return [*previous_prompt, *previous_output, *self.user_messages[turn]]


def conversations(
    *,
    num_conversations: int,
    num_tenants: int,
    system_len: int,
    num_turns: int,
    message_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[Conversation]:
    """A multi-tenant chat trace: ``num_tenants`` system prompts of ``system_len``
    random tokens; each conversation picks a tenant uniformly and has ``num_turns``
    user messages of ``message_len = (lo, hi)`` tokens (both inclusive, ``lo >= 1``).
    A bad knob raises :class:`WorkloadError` naming it and its value."""
    for name, value, minimum in (
        ("num_conversations", num_conversations, 1),
        ("num_tenants", num_tenants, 1),
        ("system_len", system_len, 0),
        ("num_turns", num_turns, 1),
        ("vocab_size", vocab_size, 1),
        ("seed", seed, 0),
    ):
        check_int(name, value, minimum=minimum, error=WorkloadError)
    lo, hi = check_int_range("message_len", message_len, error=WorkloadError)
    rng = np.random.default_rng(seed)
    systems = [tuple(rng.integers(0, vocab_size, system_len).tolist()) for _ in range(num_tenants)]
    out = []
    for _ in range(num_conversations):
        tenant = int(rng.integers(num_tenants))
        messages = tuple(
            tuple(rng.integers(0, vocab_size, int(rng.integers(lo, hi + 1))).tolist()) for _ in range(num_turns)
        )
        out.append(Conversation(tenant, systems[tenant], messages))
    return out
