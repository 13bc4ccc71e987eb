"""vLLM's own KV cache manager behind the calls jaxkv's scheduler makes.

``scripts/bench_hybrid.py`` replays one trace through :class:`jaxkv.serving.simulator.Simulator`
twice: over jaxkv's manager and over vLLM v1's ``KVCacheManager`` (0.33) built for the same
blocks, so the two runs differ only in the manager. :class:`VllmManager` keeps a vLLM
``Request`` beside each jaxkv one (same id and tokens; it hashes itself as vLLM's does), copies
the scheduler's ``num_computed_tokens`` onto it before each call, and answers the calls of
:class:`jaxkv.serving.scheduler.ScheduledManager`. vLLM's scheduler, not its manager, cuts a
recurrent model's prefill chunks (align mode: chunks end at block boundaries and at the
junction a prefix lookup reports): :meth:`VllmManager.chunk_limit` runs that rule of vLLM's
scheduler, with the settings of a default engine (no speculative decoding, no connector).

The vLLM side is built from a jaxkv plan in vLLM's layout (``state_layout="attention_pages"``,
one block size for all groups, a state per page, align mode) with the block sizes vLLM's
engine would resolve: the scheduler's block is the lcm of the groups', the hash block their gcd.

vLLM is a benchmark-only extra, never a dependency (:func:`vllm_available`). Benchmark-only:
nothing under ``jaxkv/`` imports this module.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import types
from collections.abc import Iterator, Sequence
from typing import Any

from jaxkv.core.manager import PrefixCacheStats, Request
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


class PeerError(JaxkvError):
    """vLLM is missing, or cannot express a plan (a spec it has no counterpart for here)."""


def vllm_available() -> bool:
    """Whether vLLM's v1 manager is importable (the ``vllm`` benchmark extra)."""
    try:
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except ImportError:
        return False
    return True


def _vllm(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise PeerError(f"vLLM is not importable ({e}); BUILD.md says how to install the benchmark extra") from e


def vllm_spec(spec: KVCacheSpec, block_size: int) -> Any:
    """vLLM's spec of one jaxkv group (a recurrent one in align mode)."""
    torch = _vllm("torch")
    iface = _vllm("vllm.v1.kv_cache_interface")
    if isinstance(spec, MambaSpec):
        dtypes = tuple(getattr(torch, d) for d in spec.dtypes)
        return iface.MambaSpec(block_size=block_size, shapes=spec.shapes, dtypes=dtypes, mamba_cache_mode="align")
    if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        common = dict(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size)
        dtype = getattr(torch, spec.dtype)
        if isinstance(spec, SlidingWindowSpec):
            return iface.SlidingWindowSpec(**common, dtype=dtype, sliding_window=spec.sliding_window)
        return iface.FullAttentionSpec(**common, dtype=dtype)
    raise PeerError(f"no vLLM counterpart wired here for {spec!r}")


class VllmManager:
    """vLLM's ``KVCacheManager`` over ``config``'s blocks, answering jaxkv's scheduler."""

    def __init__(self, config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int) -> None:
        if config.shared_states is not None or config.state_pool is not None:
            raise PeerError("vLLM has no shared-pages or state-pool layout: plan with state_layout='attention_pages'")
        iface = _vllm("vllm.v1.kv_cache_interface")
        sizes = [g.block_size for g in config.groups]
        groups = [iface.KVCacheGroupSpec(list(g.layer_names), vllm_spec(g.spec, g.block_size)) for g in config.groups]
        self.config = config
        self.max_model_len = max_model_len
        self._manager = _vllm("vllm.v1.core.kv_cache_manager").KVCacheManager(
            iface.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups),
            max_model_len=max_model_len,
            scheduler_block_size=math.lcm(*sizes),
            hash_block_size=math.gcd(*sizes),
            enable_caching=True,
        )
        utils = _vllm("vllm.v1.core.kv_cache_utils")
        sha256 = _vllm("vllm.utils.hashing").sha256
        utils.init_none_hash(sha256)
        self._hasher = utils.get_request_block_hasher(math.gcd(*sizes), sha256)
        self._params = _vllm("vllm.sampling_params").SamplingParams(max_tokens=max_model_len)
        self._request_type = _vllm("vllm.v1.request").Request
        self._scheduler = self._align_mode_scheduler(config, max_num_batched_tokens)
        self._peers: dict[str, Any] = {}
        self._held: set[str] = set()
        self._num_lookups = self._num_queried = self._num_hits = 0

    def _align_mode_scheduler(self, config: KVCacheConfig, max_num_batched_tokens: int) -> Any:
        """A stand-in for vLLM's scheduler that has just what its chunk rule for align mode
        reads, a default engine's settings (None without recurrent groups: vLLM then does
        not cut chunks)."""
        if not any(isinstance(g.spec, MambaSpec) for g in config.groups):
            return None
        if len({g.block_size for g in config.groups}) > 1:  # vLLM would take sub-block hits: another rule
            raise PeerError("recurrent groups beside groups of other block sizes are not wired to vLLM's side here")
        scheduler = _vllm("vllm.v1.core.sched.scheduler").Scheduler
        block_size = math.lcm(*(g.block_size for g in config.groups))
        return types.SimpleNamespace(
            split=scheduler._mamba_block_aligned_split,
            cache_config=types.SimpleNamespace(block_size=block_size),
            block_size=block_size,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            hash_block_size=math.gcd(*(g.block_size for g in config.groups)),
            max_num_scheduled_tokens=max_num_batched_tokens,
            mamba_partial_cache_hit=False,
            mamba_shared_prefix_checkpoint=False,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
            use_eagle_block_drop=False,
            num_hash_lookahead_tokens=0,
        )

    def _peer(self, request: Request) -> Any:
        """vLLM's request for ``request``, its computed tokens copied over."""
        peer = self._peers.get(request.request_id)
        if peer is None:
            if request.lora_name is not None:
                raise PeerError(f"request {request.request_id!r}: LoRA adapters are not wired to vLLM's side here")
            peer = self._request_type(
                request.request_id,
                list(request.prompt_token_ids),
                self._params,
                None,
                cache_salt=request.cache_salt,
                block_hasher=self._hasher,
            )
            self._peers[request.request_id] = peer
        peer.num_computed_tokens = request.num_computed_tokens
        return peer

    # ----------------------------------------------------------- what the scheduler reads
    @property
    def usage(self) -> float:
        return float(self._manager.usage)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._held

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_lookups, self._num_queried, self._num_hits, 0)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(self._manager.get_block_ids(request_id))

    # ----------------------------------------------------------- what the scheduler does
    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        peer = self._peer(request)
        blocks, num_hit, peer.shared_prefix_boundary = self._manager.get_computed_blocks(peer)
        self._num_lookups += 1
        self._num_queried += request.num_tokens
        self._num_hits += num_hit
        return blocks, num_hit

    def chunk_limit(
        self, request: Request, start: int, num_new_tokens: int, max_chunk_tokens: int | None = None
    ) -> int:
        scheduler = self._scheduler
        if scheduler is None:
            return num_new_tokens
        if max_chunk_tokens is not None:
            scheduler.max_num_scheduled_tokens = max_chunk_tokens
        peer = self._peer(request)
        return int(scheduler.split(scheduler, peer, num_new_tokens, start - peer.num_computed_tokens))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks: Any = None
    ) -> Any:
        peer = self._peer(request)
        blocks = self._manager.allocate_slots(peer, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        if blocks is not None:
            self._held.add(request.request_id)
        return blocks

    def allocate_decode_slots(self, requests: Sequence[Request]) -> int:
        """One slot each, in order, as vLLM's scheduler asks for them; the number served."""
        for k, request in enumerate(requests):
            if self.allocate_slots(request, 1) is None:
                return k
        return len(requests)

    def append_token_ids(self, requests: Sequence[Request], token_ids: Sequence[int]) -> None:
        """The sampled tokens, to both requests: jaxkv's (the scheduler reads it) and vLLM's."""
        for request, token in zip(requests, token_ids, strict=True):
            request.append_output_token_ids(token)
            self._peer(request).append_output_token_ids(token)

    @contextlib.contextmanager
    def step_transaction(self) -> Iterator[None]:
        """A step: vLLM's manager is told it starts, as vLLM's scheduler tells it (a state
        cached in one step is no hit before the next)."""
        self._manager.new_step_starts()
        yield

    def free(self, request: Request) -> None:
        self._manager.free(self._peer(request))
        self._held.discard(request.request_id)
