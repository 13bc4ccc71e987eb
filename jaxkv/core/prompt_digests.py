"""Block digests of recently hashed prompts, so that a prompt starting like one of them
(a shared system prompt, the previous turn of a chat) takes the digests of the blocks
they share instead of hashing those blocks again.

A chained digest names the whole prefix up to its block, so two prompts with the same
token bytes up to block ``k`` and the same extra keys have the same digests up to ``k``:
reusing them is exact, not a guess. Prompts are found by their first block's bytes, one
dict lookup and one store per prompt, so prompts that share nothing pay almost nothing.
Host-only: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.core.hashing import ExtraKeys

DEFAULT_BUDGET_BYTES = 256 << 10
"""Prompt bytes the memo keeps alive at most (their digests add about as much again).
One entry per first block: a few system prompts or chat templates fill it; beyond that,
what it keeps alive costs every prompt more in memory traffic than it saves."""


class PromptDigests:
    """The newest hashed prompt for each first block, with its digests (see the module doc)."""

    def __init__(self, block_bytes: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._block_bytes = block_bytes
        self._budget = budget_bytes
        self._size = 0
        # first block's bytes -> (prompt bytes, extra keys, the digests of its full blocks)
        self._entries: dict[bytes, tuple[bytes, ExtraKeys, list[bytes]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def shared(self, prompt: bytes, extra: ExtraKeys) -> list[bytes]:
        """Digests of the leading full blocks of ``prompt`` (little-endian int32 ids) that
        a remembered prompt with the same extra keys shares; ``[]`` when none does."""
        bb = self._block_bytes
        entry = self._entries.get(prompt[:bb])
        if entry is None:
            return []
        other, other_extra, digests = entry
        if other_extra is not extra and other_extra != extra:
            return []
        return digests[: _common_blocks(prompt, other, bb)]

    def remember(self, prompt: bytes, extra: ExtraKeys, digests: Sequence[bytes]) -> None:
        """Keep ``prompt`` as the newest prompt starting with its first block, with the
        digests of its full blocks (the first of ``digests``, which may go on past the
        prompt); the oldest go once the budget is spent."""
        bb = self._block_bytes
        if len(prompt) < bb:
            return
        key = prompt[:bb]
        old = self._entries.pop(key, None)
        if old is not None:
            self._size -= len(old[0])
        self._entries[key] = (prompt, extra, list(digests[: len(prompt) // bb]))
        self._size += len(prompt)
        while self._size > self._budget and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            self._size -= len(self._entries.pop(oldest)[0])


def _common_blocks(a: bytes, b: bytes, block_bytes: int) -> int:
    """How many leading blocks ``a`` and ``b`` share, given that the first one is shared:
    galloping, then bisecting, comparing only the blocks not yet known to agree (a prompt
    that leaves a shared template early costs one short comparison)."""
    most = min(len(a), len(b)) // block_bytes
    agree = 1
    probe = 2
    while (
        probe <= most and a[agree * block_bytes : probe * block_bytes] == b[agree * block_bytes : probe * block_bytes]
    ):
        agree, probe = probe, 2 * probe
    differ = min(probe, most + 1)  # the first block count known not to agree (or past the end)
    while differ - agree > 1:
        mid = (agree + differ) // 2
        if a[agree * block_bytes : mid * block_bytes] == b[agree * block_bytes : mid * block_bytes]:
            agree = mid
        else:
            differ = mid
    return agree
