"""Block hashes of prompt prefixes that hit the prefix cache, for the next prompt that
starts the same way.

A prompt's block hashes cost one digest per block (~0.34 µs for sha256 here), and a
shared prefix (a system prompt, an earlier turn of a chat) is hashed again by every
request that carries it. :class:`PrefixDigests` remembers the hashes of a prefix once a
lookup has hit it (sharing seen, not guessed), keyed by the prefix's packed token bytes
and the request's extra keys. A later prompt finds candidates by its first block (one
dict lookup) and takes the longest remembered prefix it starts with (a byte comparison),
then hashes only the rest. A workload that shares nothing pays the dict lookup.

Exact by construction: the same bytes and extra keys through the manager's one hasher
give the same hashes. Bounded: at most ``max_bytes`` of prefixes and hashes, oldest first
out, and ``per_head`` prefixes per first block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from jaxkv.hashing import ExtraKeys
from jaxkv.ints import check_int

__all__ = ["PrefixDigests"]


class _Prefix(NamedTuple):
    token_bytes: bytes
    extra: ExtraKeys
    hashes: tuple[bytes, ...]

    @property
    def size(self) -> int:
        """Bytes it holds (its token bytes and its hashes)."""
        return len(self.token_bytes) + sum(map(len, self.hashes))


class PrefixDigests:
    """Remembered prefixes of one hasher's prompts (``step``: bytes of one hashed block)."""

    __slots__ = ("_by_head", "_bytes", "_max_bytes", "_order", "_per_head", "_step")

    def __init__(self, step: int, *, max_bytes: int = 16 << 20, per_head: int = 8) -> None:
        self._step = check_int("step", step)
        self._max_bytes = check_int("max_bytes", max_bytes)
        self._per_head = check_int("per_head", per_head)
        self._by_head: dict[bytes, list[_Prefix]] = {}  # longest first
        self._order: deque[tuple[bytes, _Prefix]] = deque()  # recorded order, for eviction
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def take(self, prompt_bytes: bytes, extra: ExtraKeys) -> tuple[bytes, ...]:
        """The hashes of the longest remembered prefix ``prompt_bytes`` starts with
        under ``extra`` (empty when none)."""
        for prefix in self._by_head.get(prompt_bytes[: self._step], ()):
            if (prefix.extra is extra or prefix.extra == extra) and prompt_bytes.startswith(prefix.token_bytes):
                return prefix.hashes
        return ()

    def record(self, prompt_bytes: bytes, extra: ExtraKeys, hashes: Sequence[bytes]) -> None:
        """Remember that the prompt's first ``len(hashes)`` blocks (at most its prompt's
        whole blocks) hash to ``hashes``: a lookup just hit them."""
        n = min(len(hashes), len(prompt_bytes) // self._step)
        if n == 0:
            return
        token_bytes = prompt_bytes[: n * self._step]
        head = token_bytes[: self._step]
        known = self._by_head.setdefault(head, [])
        for prefix in known:
            if (
                len(prefix.token_bytes) == len(token_bytes)
                and prefix.extra == extra
                and prefix.token_bytes == token_bytes
            ):
                return
        prefix = _Prefix(token_bytes, extra, tuple(hashes[:n]))
        if prefix.size > self._max_bytes:
            return
        if len(known) >= self._per_head:
            oldest = min(known, key=self._age)
            self._forget(head, oldest)
        known.append(prefix)
        known.sort(key=lambda p: -len(p.token_bytes))
        self._order.append((head, prefix))
        self._bytes += prefix.size
        while self._bytes > self._max_bytes:
            self._forget(*self._order[0])

    def _age(self, prefix: _Prefix) -> int:
        """Position of ``prefix`` in the recorded order (0: the oldest)."""
        return next(i for i, (_, p) in enumerate(self._order) if p is prefix)

    def _forget(self, head: bytes, prefix: _Prefix) -> None:
        known = self._by_head[head]
        known.remove(prefix)
        if not known:
            del self._by_head[head]
        self._order.remove((head, prefix))
        self._bytes -= prefix.size
