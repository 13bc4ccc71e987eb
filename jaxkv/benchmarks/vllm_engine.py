"""vLLM 0.33's own engine loop on the host, fed the tokens another engine sampled.

``scripts/bench_engine.py`` times jaxkv's :class:`~jaxkv.serving.engine.Engine` step against
what vLLM's engine does on the host each step: its v1 scheduler (``schedule()`` and
``update_from_output()``, the class a default ``VllmConfig`` picks: the async scheduler
in 0.33) and its ``OutputProcessor`` (incremental detokenization, stop checks, the
request outputs), both built as vLLM's ``EngineCore`` and ``LLMEngine`` build them. No
model runs on this side: :meth:`VllmEngineLoop.step` hands the scheduler, as the model
runner's output, the token each request drew in jaxkv's run (its next one, in order), so
both sides see the same requests and tokens. The model runner's own host work (input
preparation, block tables) is not part of vLLM's figures here.

vLLM's ``ModelConfig`` reads the checkpoint directory's ``config.json`` offline and inspects
the model class, which imports ``einops`` (``pip install einops`` beside the benchmark
extra). ``DeviceConfig(device="cpu")`` is given because a GPU build of vLLM cannot infer a
device on a CPU machine. Benchmark-only: nothing under ``jaxkv/`` imports this module.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jaxkv.benchmarks.vllm_manager import PeerError, vllm_spec
from jaxkv.planner import KVCacheConfig

TOKENIZER_FILE = "tokenizer.json"


_VLLM_NAMES = {
    "transformers": ("PreTrainedTokenizerFast",),
    "vllm.config": ("CacheConfig", "DeviceConfig", "ModelConfig", "SchedulerConfig", "VllmConfig"),
    "vllm.sampling_params": ("RequestOutputKind", "SamplingParams"),
    "vllm.tokenizers.hf": ("get_cached_tokenizer",),
    "vllm.utils.hashing": ("sha256",),
    "vllm.v1.core.kv_cache_utils": ("get_request_block_hasher", "init_none_hash"),
    "vllm.v1.engine": ("EngineCoreRequest",),
    "vllm.v1.engine.output_processor": ("OutputProcessor",),
    "vllm.v1.kv_cache_interface": ("KVCacheConfig", "KVCacheGroupSpec"),
    "vllm.v1.outputs": ("ModelRunnerOutput",),
    "vllm.v1.request": ("Request", "RequestStatus"),
    "vllm.v1.structured_output": ("StructuredOutputManager",),
}
"""The vLLM (and transformers) names this loop builds with, by module."""


def _vllm_modules() -> SimpleNamespace:
    """The names of :data:`_VLLM_NAMES`; :class:`PeerError` when vLLM is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        found = {
            name: getattr(importlib.import_module(module), name)
            for module, names in _VLLM_NAMES.items()
            for name in names
        }
    except ImportError as e:
        raise PeerError(f"vLLM is not importable ({e}); BUILD.md says how to install the benchmark extra") from e
    return SimpleNamespace(**found)


@dataclass(frozen=True)
class VllmStepTimes:
    """Thread CPU seconds of one vLLM step, by phase, and what it scheduled."""

    schedule_s: float
    update_s: float
    output_s: float
    num_scheduled_tokens: int
    num_running: int
    num_finished: int

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.update_s + self.output_s


class VllmEngineLoop:
    """vLLM's scheduler and output processor over ``kv_config``'s blocks and groups (the
    plan jaxkv's engine runs, in vLLM's specs), for the checkpoint in ``model_dir``
    (its ``config.json`` and :data:`TOKENIZER_FILE`), with ``eos_token`` the
    tokenizer's end-of-text token."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_config: KVCacheConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token: str,
    ) -> None:
        v = _vllm_modules()
        if kv_config.max_model_len is None:
            raise PeerError("the plan has max_model_len=None; vLLM's scheduler needs one")
        sizes = [g.block_size for g in kv_config.groups]
        block_size, hash_block_size = math.lcm(*sizes), math.gcd(*sizes)
        try:
            model = v.ModelConfig(
                model=str(model_dir), skip_tokenizer_init=True, max_model_len=kv_config.max_model_len, dtype="float32"
            )
        except Exception as e:  # pydantic's ValidationError names why (a missing package, a length)
            raise PeerError(f"vLLM's ModelConfig refused {model_dir}: {e}") from e
        config = v.VllmConfig(
            model_config=model,
            cache_config=v.CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=v.SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=kv_config.max_model_len,
                is_encoder_decoder=False,
            ),
            device_config=v.DeviceConfig(device="cpu"),
        )
        config.cache_config.num_gpu_blocks = kv_config.num_blocks
        groups = [v.KVCacheGroupSpec(list(g.layer_names), vllm_spec(g.spec, g.block_size)) for g in kv_config.groups]
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=v.KVCacheConfig(
                num_blocks=kv_config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
            ),
            structured_output_manager=v.StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=False,
        )
        self.scheduler_name = scheduler_cls.__name__
        tokenizer = v.PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / TOKENIZER_FILE), eos_token=eos_token)
        self.tokenizer = v.get_cached_tokenizer(tokenizer)
        self.output_processor = v.OutputProcessor(self.tokenizer, log_stats=False)
        v.init_none_hash(v.sha256)
        self._hasher = v.get_request_block_hasher(hash_block_size, v.sha256)
        self._v = v

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """Queue a request that ignores EOS and streams deltas (as a server's request does),
        in the output processor and the scheduler, as ``LLMEngine.add_request`` does."""
        v = self._v
        params = v.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=v.RequestOutputKind.DELTA
        )
        params.update_from_tokenizer(self.tokenizer)
        request = v.EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=request_id,
        )
        self.output_processor.add_request(request, None, None, 0, None)
        self.scheduler.add_request(v.Request.from_engine_core_request(request, self._hasher))

    @property
    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self, tokens: Mapping[str, Sequence[int]]) -> VllmStepTimes:
        """One step: schedule, the model runner's output (each request that completes its
        prompt or decodes draws its next token of ``tokens``; untimed), the scheduler's
        update and the output processor; each phase timed in thread CPU seconds."""
        start = time.thread_time()
        output = self.scheduler.schedule()
        scheduled = time.thread_time()
        runner_output = self._runner_output(output, tokens)
        ran = time.thread_time()
        core_outputs = self.scheduler.update_from_output(output, runner_output)
        updated = time.thread_time()
        num_finished = 0
        for outputs in core_outputs.values():
            processed = self.output_processor.process_outputs(outputs.outputs)
            if processed.reqs_to_abort:  # stop strings the output processor found
                self.scheduler.finish_requests(processed.reqs_to_abort, self._v.RequestStatus.FINISHED_ABORTED)
            num_finished += sum(o.finished for o in processed.request_outputs)
        processed_at = time.thread_time()
        return VllmStepTimes(
            scheduled - start,
            updated - ran,
            processed_at - updated,
            output.total_num_scheduled_tokens,
            len(self.scheduler.running),
            num_finished,
        )

    def _runner_output(self, output: Any, tokens: Mapping[str, Sequence[int]]) -> Any:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            sampled.append([] if request.is_prefill_chunk else [tokens[req_id][request.num_output_tokens]])
        return self._v.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
