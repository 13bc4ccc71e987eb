"""The salts recent salted prompts were looked up under, by their first block, to tell a
miss a salt mismatch causes from a prompt never cached.

A cache salt goes into a prompt's first block hash only, and every later hash chains from
it, so the same tokens under another salt (or none) share no hash with it: by its own
hashes such a miss looks like a prompt no one sent. To count it apart, the manager asks
this memo, on a salted request's miss at its first block, which other keys the same
first block was seen with (none, and the newest other salt), hashes the prompt under
them and counts what full attention has cached that way. Unsalted requests never reach
it. Bounded: the oldest first blocks are forgotten first. Host-only: no JAX.
"""

from __future__ import annotations

import dataclasses

from jaxkv.core.hashing import ExtraKeys

SALTED_PREFIXES = 4096
"""First blocks remembered at most (each keeps its bytes and one extra keys object)."""


class SaltedPrefixes:
    """Per first block of a salted prompt (its little-endian int32 bytes), the extra keys
    of the newest salted prompt looked up with it."""

    def __init__(self, block_bytes: int, capacity: int = SALTED_PREFIXES) -> None:
        self._block_bytes = block_bytes
        self._capacity = capacity
        self._keys: dict[bytes, ExtraKeys] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def others(self, prompt: bytes, extra: ExtraKeys) -> list[ExtraKeys]:
        """The keys ``prompt`` (salted with ``extra``) may have been cached under instead:
        ``extra`` without its salt, then the newest other salt seen with its first block."""
        others = [dataclasses.replace(extra, cache_salt=None)]
        seen = self._keys.get(prompt[: self._block_bytes])
        if seen is not None and seen.cache_salt != extra.cache_salt:
            others.append(seen)
        return others

    def note(self, prompt: bytes, extra: ExtraKeys) -> None:
        """A prompt salted with ``extra`` was looked up: remember its salt for its first block."""
        key = prompt[: self._block_bytes]
        if len(key) < self._block_bytes:
            return
        keys = self._keys
        keys.pop(key, None)
        keys[key] = extra
        if len(keys) > self._capacity:
            del keys[next(iter(keys))]
