"""The Mosaic GPU paged-attention kernel (jaxkv.pallas.gpu) against the jnp reference.

On CPU the kernel runs in the Mosaic GPU interpreter (its two wgmma products as
``dot_general``, see the kernel's docstring) and is lowered for CUDA, which runs Mosaic
GPU's layout checks on the wgmma path; on a GPU it is compiled and run. Bytes the
kernel must not read are NaN (:mod:`paged_batches`), and the interpreter fills shared
memory with NaN, so a stray read shows up in the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from paged_batches import AttentionCase, compare_attention, make_batch, random_batch

from jaxkv.pallas import gpu as kernels
from jaxkv.pallas.gpu.paged_attention import AttentionTuning
from jaxkv.pallas.reference import KVShapeError

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU

CASES = {
    "bf16-gqa4-per-layer": AttentionCase(
        jnp.bfloat16,
        num_kv_heads=2,
        num_queries_per_kv=4,
        head_dim=128,
        block_size=16,
        num_decodes=3,
        num_prefills=2,
        max_len=150,
    ),
    "bf16-gqa8-cross-layer-window-cap-splits": AttentionCase(
        jnp.bfloat16,
        num_kv_heads=1,
        num_queries_per_kv=8,
        head_dim=64,
        block_size=32,
        num_decodes=2,
        num_prefills=2,
        max_len=200,
        window=40,
        soft_cap=5.0,
        layer_index=1,
        tuning=AttentionTuning(num_kv_splits=3),
    ),
    "fp16-mha-big-pages-window": AttentionCase(
        jnp.float16,
        num_kv_heads=1,
        num_queries_per_kv=1,
        head_dim=64,
        block_size=128,
        num_decodes=2,
        num_prefills=1,
        max_len=300,
        window=70,
        tuning=AttentionTuning(num_stages=2),
    ),
    "bf16-gqa2-chunk128": AttentionCase(
        jnp.bfloat16,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=64,
        block_size=16,
        num_decodes=1,
        num_prefills=2,
        max_len=260,
        tuning=AttentionTuning(kv_tokens_per_chunk=128),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference(rng, case):
    c = CASES[case]
    batch = c.batch(rng, num_layers_per_block=2)
    kernel = functools.partial(kernels.paged_attention, interpret=INTERPRET)
    compare_attention(
        kernel,
        rng,
        batch,
        layer_index=c.layer_index,
        sm_scale=c.head_dim**-0.5,
        window=c.window,
        soft_cap=c.soft_cap,
        tuning=c.tuning or AttentionTuning(),
    )


@pytest.mark.slow
def test_kv_splits_do_not_change_the_result(rng):
    """One long decode split over 1 and 4 CTAs, and a prefill chunk: the merge is exact."""
    batch = make_batch(
        rng,
        [(1, 500), (30, 90)],
        max_seqs=2,
        block_size=16,
        num_kv_heads=1,
        num_queries_per_kv=4,
        head_dim=64,
        dtype=jnp.bfloat16,
    )
    outs = [
        compare_attention(
            functools.partial(kernels.paged_attention, interpret=INTERPRET, tuning=AttentionTuning(num_kv_splits=n)),
            rng,
            batch,
            sm_scale=0.125,
        )
        for n in (1, 4)
    ]
    assert abs(outs[0] - outs[1]).max() <= 1e-2


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel is compiled and run by the tests above")
@pytest.mark.parametrize("layer_index, window, soft_cap", [(None, None, None), (1, 48, 30.0)])
def test_kernel_lowers_for_cuda(rng, layer_index, window, soft_cap):
    """Lowering runs Mosaic GPU's own checks of the wgmma path (register layouts, TMA,
    shared-memory transforms) that the interpreter skips."""
    batch = random_batch(rng, jnp.bfloat16, 8, 4, 128, 16, 16, 2, 2048, window=window, layer_index=layer_index)

    def attention(*args):
        return kernels.paged_attention(
            *args, layer_index=layer_index, sm_scale=0.088, sliding_window=window, soft_cap=soft_cap
        )

    lowered = jax.jit(attention).trace(*batch.args(batch.kv_poisoned)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "dtype, g, d, bs, match",
    [
        (jnp.float32, 4, 128, 16, "bf16 or fp16"),
        (jnp.bfloat16, 3, 128, 16, "must divide 64"),
        (jnp.bfloat16, 4, 96, 16, "multiple of 64"),
        (jnp.bfloat16, 4, 128, 48, "one must divide the other"),
    ],
)
def test_shapes_the_tiles_do_not_fit_are_refused_by_name(rng, dtype, g, d, bs, match):
    batch = random_batch(rng, dtype, 1, g, d, bs, 1, 0, 20)
    with pytest.raises(KVShapeError, match=match):
        kernels.paged_attention(*batch.args(batch.kv_clean), sm_scale=0.1, interpret=True)


@pytest.mark.parametrize("knob", ["num_kv_splits", "kv_tokens_per_chunk", "num_stages"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_tuning_knob_is_refused_when_the_tuning_is_built(knob, bad):
    with pytest.raises(KVShapeError, match=f"AttentionTuning.{knob}"):
        AttentionTuning(**{knob: bad})


def test_the_tuning_defaults_leave_the_splits_to_the_kernel():
    assert AttentionTuning().num_kv_splits is None and hash(AttentionTuning()) == hash(AttentionTuning())
