"""The wire between a router and its replicas (:mod:`jaxkv.fleet.replica`,
:mod:`jaxkv.fleet.router`): their addresses and messages, msgpack-encoded msgspec
structs tagged by class name, one per ZeroMQ frame. Imports no JAX, so a router
process need not carry it.

A client (a DEALER on the replica's ``requests`` ROUTER) sends
:class:`GenerateRequest`, :class:`CancelRequest` or :class:`ResetPrefixCache`; the
replica answers each request with :class:`GenerateResult`, :class:`GenerateFailure`
or :class:`CacheReset`; a cancel is not answered (the request it stops gets no
answer: its client has answered it already). Request ids are the client's: a replica keeps each
client's apart, so two routers never collide. The replica publishes a
:class:`Heartbeat` on ``heartbeats`` every interval.

Size: a replica announces its limits in its heartbeats (``max_model_len``: a prompt
must be shorter; ``max_request_bytes``: :func:`max_request_bytes` of it, the longest
request frame it reads), and a router refuses a request over them before sending it.
A frame over ``max_request_bytes`` that still arrives is answered with a
:class:`GenerateFailure` naming the limit, without decoding its prompt, and the
connection stays up: the socket's own limit (``MAXMSGSIZE``, past which ZeroMQ drops
the connection) is :func:`max_frame_bytes`, ``FRAME_LIMIT_FACTOR`` times larger, for
clients that ignore the announced limit several times over. A message of other than
one frame is counted and skipped.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from jaxkv.serving.zmq_security import check_endpoint

MAX_TOKEN_BYTES = 9
"""The most bytes one token id takes in msgpack (a 64-bit int)."""
REQUEST_OVERHEAD_BYTES = 64 << 10
"""Room for a request's other fields (its id, limits, cache salt)."""


FRAME_LIMIT_FACTOR = 4
"""The socket's frame limit over the announced request limit (see the module docstring)."""


def max_request_bytes(max_model_len: int) -> int:
    """The longest request frame a replica of ``max_model_len`` accepts: a prompt of
    ``max_model_len`` 64-bit token ids and the other fields."""
    return MAX_TOKEN_BYTES * max_model_len + REQUEST_OVERHEAD_BYTES


def max_frame_bytes(max_model_len: int) -> int:
    """The replica socket's ``MAXMSGSIZE``: frames up to it are read (and those over
    :func:`max_request_bytes` answered with a failure), longer ones drop the connection."""
    return FRAME_LIMIT_FACTOR * max_request_bytes(max_model_len)


class RequestId(msgspec.Struct):
    """A request's id alone: what a replica reads of a frame over its limit (the prompt
    is skipped, never decoded into a list)."""

    request_id: str = ""


class GenerateRequest(msgspec.Struct, tag=True):
    """Generate greedily from ``prompt_token_ids``; ``request_id`` names the answer."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    cache_salt: str | None = None


class CancelRequest(msgspec.Struct, tag=True):
    """Stop ``request_id`` (the router took it elsewhere, its deadline passed or its
    caller cancelled it): the replica frees what it holds."""

    request_id: str


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
    """The replica is alive; ``load`` = running + waiting requests; ``steps``: engine
    steps run since it started (its progress); ``busy``: it has unfinished requests
    (for monitoring: a router judges a hang by its own requests in flight, since a loop
    stuck while idle says "not busy"); ``instance``: a token drawn
    at its start (a new one: it restarted); ``slots`` and ``step_tokens``: its engine's
    running requests and tokens per step at most; ``max_model_len`` and
    ``max_request_bytes``: its request limits (see the module docstring; 0: not said);
    ``compiling``: its serving thread is inside JAX (tracing, lowering or compiling a
    new step shape) as the beat is sent, progress a step count cannot show (a compile
    can take longer than a router's hang timeout)."""

    replica: str
    seq: int
    load: int
    steps: int = 0
    busy: bool = False
    instance: str = ""
    slots: int = 0
    step_tokens: int = 0
    max_model_len: int = 0
    max_request_bytes: int = 0
    compiling: bool = False


ToReplica = GenerateRequest | CancelRequest | ResetPrefixCache
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
