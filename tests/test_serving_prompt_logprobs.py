"""Prompt log-probabilities from the step variant that keeps logits at every new token,
against the dense forward of the same model (chunked prefill and a prefix-cache hit included)
and against transformers' own logits on the stored tiny checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import save_tiny_checkpoint

from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.outputs import CacheAudit
from jaxkv.serving.runner import ModelRunner
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.scheduler import Scheduler

pytestmark = pytest.mark.slow  # compiles a step and a dense forward


def dense_logprobs(model, tokens: list[int]) -> np.ndarray:
    """(len(tokens), vocab) log-probabilities of the next token after each one, dense."""
    padded = np.zeros((1, 128), np.int32)
    padded[0, : len(tokens)] = tokens
    logits = jax.jit(model.dense)(model.params, jnp.asarray(padded))[0, : len(tokens)]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))


def test_every_prompt_token_is_scored_as_the_dense_forward_scores_it():
    model = TinyLM(get_model_config("tiny-hybrid"), seed=0)
    plan = plan_kv_cache(
        model.config.layer_specs(), 2 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    runner = ModelRunner(model, plan, Buckets((64,), (4,), (16,)))
    scheduler = Scheduler(KVCacheManager(plan), max_num_seqs=4, max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    long, short = rng.integers(0, 512, 100).tolist(), rng.integers(0, 512, 30).tolist()
    again = long[:64] + rng.integers(0, 512, 20).tolist()  # shares 4 full blocks with `long`
    scored: dict[str, dict[int, tuple]] = {}
    for batch in ([("long", long), ("short", short)], [("again", again)]):
        for rid, prompt in batch:
            scheduler.add_request(Request(rid, prompt), 1)
        while scheduler.has_unfinished:
            out = scheduler.schedule()
            sampled, _, per_chunk = runner.collect(runner.dispatch(out.chunks, score_prompt=True))
            for chunk, lp in zip(out.chunks, per_chunk, strict=True):
                for j in range(chunk.num_new_tokens):
                    scored.setdefault(chunk.seq.request_id, {})[chunk.num_computed_tokens + j] = (
                        float(lp.logprob[j]),
                        lp.top_ids[j].tolist(),
                        lp.top_logprobs[j],
                    )
            scheduler.update(out, sampled.token_ids.tolist())
    assert runner.num_compilations == 1
    for rid, prompt in (("long", long), ("short", short), ("again", again)):
        dense = dense_logprobs(model, prompt)
        first = min(scored[rid])
        assert (first > 0) == (rid == "again")  # the hit's positions were computed by no step
        for position in range(first, len(prompt) - 1):  # position p scores prompt token p + 1
            logprob, top_ids, top_logprobs = scored[rid][position]
            np.testing.assert_allclose(logprob, dense[position, prompt[position + 1]], atol=2e-4)
            assert top_ids[:5] == np.argsort(-dense[position])[:5].tolist()
            np.testing.assert_allclose(top_logprobs, np.sort(dense[position])[::-1][:20], atol=2e-4)


def test_the_engine_returns_prompt_logprobs_as_the_dense_forward_scores_them():
    engine = Engine.build("tiny-hybrid", memory_bytes=2 << 20, max_model_len=256, max_num_batched_tokens=64)
    rng = np.random.default_rng(1)
    cached = rng.integers(0, 512, 100).tolist()
    engine.generate([cached], 1)  # leaves its 6 full blocks in the prefix cache
    scored = cached[:96] + rng.integers(0, 512, 10).tolist()  # 106 tokens: two chunks, a 96-token hit skipped
    plain = rng.integers(0, 512, 20).tolist()
    ask = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=1)
    result = engine.generate([scored, plain], [ask, SamplingParams.greedy(2)])
    out, other = result.outputs
    assert out.num_cached_tokens == 0 and other.prompt_logprobs is None
    assert len(out.prompt_logprobs) == len(scored) and out.prompt_logprobs[0] is None
    dense = dense_logprobs(model=engine.model, tokens=scored)
    for position, item in enumerate(out.prompt_logprobs[1:], start=1):
        row = dense[position - 1]
        assert item.token_id == scored[position]
        np.testing.assert_allclose(item.logprob, row[scored[position]], atol=2e-4)
        target = row[scored[position]]
        assert 1 + np.sum(row > target + 2e-4) <= item.rank <= 1 + np.sum(row > target - 2e-4)
        assert [t for t, _ in item.top] == np.argsort(-row)[:3].tolist()
    assert out.output_token_ids[0] == int(np.argmax(dense[len(scored) - 1]))
    assert engine.audit() == CacheAudit(0, 0)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_prompt_logprobs_equal_transformers_log_softmax_on_the_stored_checkpoint(family, tmp_path):
    """Every prompt position's logprob and top tokens against transformers' own logits over
    the same sequence (stored in tests/oracle/), the prompt split over chunked prefill steps."""
    reference = save_tiny_checkpoint(family, tmp_path)
    engine = Engine.from_pretrained(tmp_path, memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=16)
    tokens = reference.dense_tokens
    ask = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    [out] = engine.generate([tokens], ask).outputs
    rows = np.asarray(jax.nn.log_softmax(jnp.asarray(reference.dense_logits, jnp.float32), -1))
    assert len(out.prompt_logprobs) == len(tokens) and out.prompt_logprobs[0] is None
    for position, item in enumerate(out.prompt_logprobs[1:], start=1):
        row = rows[position - 1]
        assert item.token_id == tokens[position]
        np.testing.assert_allclose(item.logprob, row[tokens[position]], atol=1e-4)
        top = np.argsort(-row)[:4]
        if np.all(-np.diff(row[top]) > 1e-3):  # no near tie among the first four
            assert [t for t, _ in item.top] == top[:3].tolist()
    assert engine.audit() == CacheAudit(0, 0)
