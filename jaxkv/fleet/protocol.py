"""The wire between a router and its replicas (:mod:`jaxkv.fleet.replica`,
:mod:`jaxkv.fleet.router`): their addresses and messages, msgpack-encoded msgspec
structs tagged by class name, one per ZeroMQ frame. Imports no JAX, so a router
process need not carry it.

A client (a DEALER on the replica's ``requests`` ROUTER) sends
:class:`GenerateRequest` or :class:`ResetPrefixCache`; the replica answers each with
:class:`GenerateResult`, :class:`GenerateFailure` or :class:`CacheReset`. The replica
publishes a :class:`Heartbeat` on ``heartbeats`` every interval.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from jaxkv.serving.kv_events import check_endpoint


class GenerateRequest(msgspec.Struct, tag=True):
    """Generate greedily from ``prompt_token_ids``; ``request_id`` names the answer."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    cache_salt: str | None = None


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget the device prefix cache (refused while requests are unfinished)."""

    request_id: str


class GenerateResult(msgspec.Struct, tag=True):
    """A finished request. ``ttft_s``: seconds from its arrival at the replica to its
    first token; ``num_cached_tokens``: its prefix-cache hit."""

    request_id: str
    replica: str
    output_token_ids: list[int]
    ttft_s: float
    num_cached_tokens: int


class GenerateFailure(msgspec.Struct, tag=True):
    """A request the replica refused or dropped (bad input, a failed step)."""

    request_id: str
    replica: str
    message: str


class CacheReset(msgspec.Struct, tag=True):
    request_id: str
    replica: str
    ok: bool


class Heartbeat(msgspec.Struct, tag=True):
    """The replica is serving; ``load`` = running + waiting requests."""

    replica: str
    seq: int
    load: int


ToReplica = GenerateRequest | ResetPrefixCache
FromReplica = GenerateResult | GenerateFailure | CacheReset


@dataclass(frozen=True)
class ReplicaAddress:
    """The ZeroMQ endpoints of one replica."""

    requests: str
    heartbeats: str
    events: str
    replay: str

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_endpoint(field.name, getattr(self, field.name))

    @classmethod
    def ipc(cls, directory: str | os.PathLike, name: str) -> ReplicaAddress:
        """IPC endpoints for replica ``name`` under ``directory`` (one machine)."""
        base = Path(directory) / name
        return cls(*(f"ipc://{base}-{kind}" for kind in ("requests", "heartbeats", "events", "replay")))
