"""The token check of two runs: fp32 tokens identical; narrow dtypes' logits within a
tolerance up to each request's first divergence; runs that cannot be compared refused."""

import numpy as np
import pytest

from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine, RequestOutput
from jaxkv.serving.logit_check import DEFAULT_TOLERANCE, LogitCheckError, compare_outputs

VOCAB = 6


def output(tokens: list[int], logits: list[list[float]] | None, prompt: tuple[int, ...] = (1, 2)) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_token_ids=prompt,
        output_token_ids=tuple(tokens),
        num_cached_tokens=0,
        num_preemptions=0,
        ttft_s=0.0,
        finish_s=0.0,
        logits=None if logits is None else np.asarray(logits, np.float32),
    )


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, VOCAB)).astype(np.float32) * 8


def test_fp32_needs_identical_tokens():
    same = compare_outputs([output([3, 4], None)], [output([3, 4], None)], dtype="float32")
    assert same.passed and same.identical_tokens and same.tolerance is None
    assert same.summary() == "PASS: float32 must give identical tokens: tokens identical (2)"
    flipped = compare_outputs([output([3, 4], None)], [output([3, 5], None)], dtype="float32")
    assert not flipped.passed and flipped.first_divergence == (0, 1)
    assert flipped.summary().startswith("FAIL: float32") and "first at request 0 token 1" in flipped.summary()


def test_bf16_judges_logits_up_to_and_including_the_first_divergence():
    base = rows(4)
    near = base + 0.01
    after = near.copy()
    after[3] += 100  # past the divergence at position 2: another text, not compared
    check = compare_outputs([output([1, 2, 3, 4], base)], [output([1, 2, 5, 0], after)], dtype="bfloat16")
    assert check.passed and not check.identical_tokens
    assert check.first_divergence == (0, 2) and check.num_positions == 3 and check.num_diverged == 1
    assert check.max_abs_diff == pytest.approx(0.01, abs=1e-5)
    assert check.max_abs_logit == pytest.approx(np.abs(base[:3]).max())
    assert check.summary().startswith("PASS: bfloat16 logits within 0.0625 x max |logit|")
    before = near.copy()
    before[1, 0] += DEFAULT_TOLERANCE * np.abs(base).max() * 2  # before the divergence: judged
    assert not compare_outputs([output([1, 2, 3, 4], base)], [output([1, 2, 5, 0], before)], dtype="bfloat16").passed
    nan = base.copy()
    nan[0, 0] = np.nan
    assert not compare_outputs([output([1, 2, 3, 4], base)], [output([1, 2, 3, 4], nan)], dtype="bfloat16").passed


def test_runs_that_cannot_be_compared_are_refused():
    a = output([1], rows(1))
    with pytest.raises(LogitCheckError, match="return_logits=True"):
        compare_outputs([a], [output([1], None)], dtype="bfloat16")
    with pytest.raises(LogitCheckError, match="other prompts"):
        compare_outputs([a], [output([1], rows(1), prompt=(9,))], dtype="bfloat16")
    with pytest.raises(LogitCheckError, match="nan"):
        compare_outputs([a], [a], dtype="bfloat16", tolerance=float("nan"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_caching_passes_the_check_on_a_real_model(dtype):
    """Cached vs uncached runs of a tiny Llama; logits come back only when asked for."""
    model = TinyLM(get_model_config("tiny-llama", dtype=dtype), seed=0)
    plan = plan_kv_cache(
        model.config.layer_specs(), 1 << 20, max_model_len=128, options=PlanOptions(max_num_batched_tokens=64)
    )
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 512, 40).tolist()
    prompts = [shared + rng.integers(0, 512, 5).tolist() for _ in range(2)]
    runs = {}
    for caching in (False, True):
        engine = Engine(model, plan, enable_caching=caching, max_num_seqs=2, buckets=Buckets((64,), (2,), (8,)))
        engine.generate(prompts[:1], 1)  # caches the shared prefix
        assert engine.generate(prompts[1:], 1).outputs[0].logits is None
        runs[caching] = engine.generate(prompts, 4, return_logits=True)
    assert runs[True].num_cached_prompt_tokens > runs[False].num_cached_prompt_tokens == 0
    assert all(o.logits.shape == (4, 512) and o.logits.dtype == np.float32 for o in runs[True].outputs)
    check = compare_outputs(runs[False].outputs, runs[True].outputs, dtype=dtype)
    assert check.passed, check.summary()
    assert check.num_positions == 8 or not check.identical_tokens  # 2 requests x 4 tokens
