"""What the engine hands back: finished sequences, per-step deltas, a ``generate`` call's result.

Plain dataclasses with no JAX in them (vLLM's ``outputs`` seam), so a server, a router or a
client names them without loading the device side: :class:`RequestDelta` is what a stream
carries, :class:`RequestOutput` a finished sequence, :class:`EngineStep` one
:meth:`~jaxkv.serving.engine.Engine.step`, :class:`GenerationResult` one
:meth:`~jaxkv.serving.engine.Engine.generate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jaxkv.serving.sampling_params import FinishReason


@dataclass(frozen=True)
class CacheAudit:
    """Blocks (device: attention blocks and state rows) held by nobody, found between
    ``generate`` calls (both must be 0)."""

    device_blocks_leaked: int
    host_blocks_leaked: int


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's log-probability and the ``logprobs`` most likely tokens' (the model's
    raw distribution), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None
    """1 + how many tokens are more likely (given for prompt tokens, as vLLM gives it)."""


@dataclass(frozen=True)
class RequestOutput:
    """One finished sequence (``index`` of its request's ``n``). Times are seconds from its
    arrival (:meth:`Engine.add_request`; ``generate`` adds its prompts at the start of the call)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int
    ttft_s: float
    finish_s: float
    logits: np.ndarray | None = None
    """``(len(output_token_ids), vocab)`` float32: the logits each output token was
    sampled from, when ``generate(..., return_logits=True)``; else None."""
    finish_reason: FinishReason = "length"
    index: int = 0
    text: str | None = None
    """The output as text (the stop string left out), when the engine has a tokenizer."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """One per output token when the request asked for ``logprobs``."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """One per prompt token when the request asked for ``prompt_logprobs``: None for the first
    (nothing precedes it), then each token scored after the ones before it (vLLM's shape)."""


@dataclass(slots=True)
class RequestDelta:
    """What one step added to one sequence: its new tokens (none for a prefill chunk that
    drew nothing is never reported), their text and log-probabilities, and
    ``finish_reason`` once the sequence ended (its blocks are then free). (Slotted and not
    frozen: every running sequence gets one per step, and a frozen dataclass's init costs
    about five times as much; the engine keeps none, so nothing of it reads a changed one.)"""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: FinishReason | None
    num_cached_tokens: int | None = None
    """On a sequence's finishing delta: the prompt tokens its first admission found cached
    (device and host tier; None for a sequence aborted before it was admitted)."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """On a sequence's first delta, when it asked for ``prompt_logprobs``: as
    :attr:`RequestOutput.prompt_logprobs`."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepProgress:
    """A snapshot after one engine step, for progress callbacks."""

    step: int
    elapsed_s: float
    num_tokens: int
    num_waiting: int
    num_running: int
    num_finished: int
    num_requests: int
    usage: float


@dataclass(frozen=True)
class EngineStep:
    """What one :meth:`Engine.step` did: the sequences it finished, the new output of every
    sequence that drew a token or ended (aborts since the last step included), the
    tokens it computed and the KV pool usage once it was scheduled."""

    finished: tuple[RequestOutput, ...]
    num_tokens: int
    usage: float
    deltas: tuple[RequestDelta, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """What one ``generate`` call did.

    ``num_cached_prompt_tokens`` counts each request's prefix-cache hit at its first
    admission; ``num_compilations`` the step-function traces during this call.
    """

    outputs: tuple[RequestOutput, ...]
    wall_s: float
    num_steps: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_scheduled_tokens: int
    num_preemptions: int
    peak_usage: float
    mean_usage: float
    num_compilations: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def scheduled_tokens_per_s(self) -> float:
        """Prefill and decode tokens computed per second."""
        return self.num_scheduled_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return float(np.mean([o.ttft_s for o in self.outputs])) if self.outputs else 0.0

    def to_dict(self) -> dict:
        """Counters, rates and per-request outputs as a JSON-able dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outputs"}
        out.update(
            prefix_hit_rate=self.prefix_hit_rate,
            output_tokens_per_s=self.output_tokens_per_s,
            scheduled_tokens_per_s=self.scheduled_tokens_per_s,
            mean_ttft_s=self.mean_ttft_s,
            outputs=[{k: v for k, v in dataclasses.asdict(o).items() if k != "logits"} for o in self.outputs],
        )
        return out
