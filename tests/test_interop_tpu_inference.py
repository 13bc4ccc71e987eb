"""jaxkv inside tpu-inference: its own reference kernels on CPU over jaxkv-managed steps.

tpu-inference's ``ref_ragged_paged_attention`` (the oracle of its TPU kernel) runs over
jaxkv's pages and step metadata mapped by :mod:`jaxkv.interop.tpu_inference`, against
jaxkv's reference, through prefix hits, a sliding window, chunked prefill and a
preemption; its Gated DeltaNet reference runs over jaxkv's recurrent state rows against
one pass over each whole sequence. Skipped, with the install line, where tpu-inference is
not installed; the mapping's own tests below run without it.
"""

import functools
import importlib.util
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core import KVCacheManager, Request
from jaxkv.device import ops
from jaxkv.device.cache import allocate_kv_cache
from jaxkv.device.metadata import Buckets, GroupKindError, ScheduledSeq, build_step_metadata, decodes_first
from jaxkv.device.state_cache import allocate_state_cache, num_state_rows
from jaxkv.interop import tpu_inference as ti
from jaxkv.planner import PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

H, QH, D = 2, 4, 128
BUCKETS = Buckets((16, 128), (4,), (8,))


@pytest.fixture(scope="module")
def tpu():
    """tpu-inference's entry points; the environment as it was before its import (which
    edits XLA_FLAGS, read by the CPU backend started here first)."""
    jax.devices()
    saved = dict(os.environ)
    try:
        loaded = ti.load_tpu_inference()
    except ti.TpuInferenceUnavailableError as error:
        pytest.skip(str(error))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return loaded


def attention_plan(layout, *, head_size=D, dtype="float32", window=24):
    specs = {
        "full": FullAttentionSpec(num_kv_heads=H, head_size=head_size, dtype=dtype),
        "window": SlidingWindowSpec(num_kv_heads=H, head_size=head_size, dtype=dtype, sliding_window=window),
    }
    return plan_kv_cache(specs, 2 << 20, max_model_len=256, options=PlanOptions(layout=layout))


def step_metadata(plan, mgr, chunks, **kw):
    """Metadata of ``chunks`` ((request, new tokens), put decodes first) and the chunks in that order."""
    seqs = [ScheduledSeq(r.request_id, r.num_computed_tokens, n) for r, n in chunks]
    order = decodes_first(seqs)
    chunks = [chunks[i] for i in order]
    md = build_step_metadata(
        [seqs[i] for i in order],
        [r.all_token_ids for r, _ in chunks],
        [mgr.get_block_ids(r.request_id) for r, _ in chunks],
        [g.block_size for g in plan.groups],
        BUCKETS,
        num_blocks=plan.num_blocks,
        group_layers=[g.layer_names for g in plan.groups],
        **kw,
    )
    return md, chunks


def admit(mgr, req, limit=None):
    """Admit ``req`` with its prefix hit and schedule the rest of its prompt (or ``limit``
    tokens of it); return the chunk."""
    hit, n = mgr.get_computed_blocks(req)
    num = (req.num_tokens - n) if limit is None else limit
    assert mgr.allocate_slots(req, num, n, hit) is not None
    req.num_computed_tokens = n
    return req, num


def extend(mgr, req, num, token=None):
    """Schedule ``num`` more tokens of a running request (a decode appends ``token`` first)."""
    if token is not None:
        req.append_output_token_ids(token)
    assert mgr.allocate_slots(req, num) is not None
    return req, num


# ---------------------------------------------------------------- without tpu-inference


def test_the_environment_supplies_what_the_import_needs_and_takes_it_back(monkeypatch):
    for name in ti.TPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_NAME", "my-vm")
    for name in ("vllm", "vllm.logger"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with ti.tpu_inference_environment():
        assert os.environ["TPU_ACCELERATOR_TYPE"] == "cpu" and os.environ["TPU_WORKER_ID"] == "0"
        assert os.environ["TPU_NAME"] == "my-vm"
        from vllm.logger import _VllmLogger, init_logger

        assert isinstance(init_logger("vllm.tpu_inference"), _VllmLogger)
    assert "vllm" not in sys.modules and "vllm.logger" not in sys.modules
    assert "TPU_ACCELERATOR_TYPE" not in os.environ and os.environ["TPU_NAME"] == "my-vm"


def test_the_environment_leaves_a_real_vllm_alone(monkeypatch):
    real = types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", real)
    monkeypatch.delitem(sys.modules, "vllm.logger", raising=False)
    with ti.tpu_inference_environment():
        assert sys.modules["vllm"] is real and "vllm.logger" not in sys.modules
    assert sys.modules["vllm"] is real


def test_request_distribution_counts_the_one_token_sequences_first():
    plan = attention_plan("per_layer")
    mgr = KVCacheManager(plan, max_model_len=256)
    rng = np.random.default_rng(1)
    a, b, c = (Request(name, rng.integers(0, 1000, 20).tolist()) for name in "abc")
    chunks = [admit(mgr, a), admit(mgr, b, 1), admit(mgr, c, 1)]
    md, _ = step_metadata(plan, mgr, chunks)
    assert ti.request_distribution(md).tolist() == [2, 2, 3]  # b's and c's one-token chunks run as decodes
    md, _ = step_metadata(plan, mgr, chunks[:1])
    assert ti.request_distribution(md).tolist() == [0, 0, 1]


@pytest.mark.parametrize("dtype, packing", [("float32", 1), ("bfloat16", 2)])
def test_per_layer_pages_are_their_layout_by_a_bitcast(dtype, packing):
    cache = allocate_kv_cache(attention_plan("per_layer", dtype=dtype))
    assert ti.pages_copy_reason(cache) is None and ti.kv_packing(cache.dtype) == packing
    (shape,) = {b.shape for b in cache.buffers}
    want = np.arange(np.prod(shape)).reshape(shape).astype(cache.dtype)
    filled = cache.replace(tuple(jnp.asarray(want) for _ in cache.buffers))
    pointer = filled.layer_buffer("window")[0].unsafe_buffer_pointer()
    pages = jax.jit(ti.layer_pages, static_argnums=1, donate_argnums=0)(filled, "window")
    assert pages.shape == (cache.num_blocks, cache.block_size, 2 * H // packing, packing, D)
    assert pages.unsafe_buffer_pointer() == pointer, "a copy, not a view"
    back = ti.with_layer_pages(cache, "window", pages)
    np.testing.assert_array_equal(np.asarray(back.layer_buffer("window")[0]), want)


def test_cross_layer_and_padded_head_dims_copy_and_write_back_only_their_layer():
    """Two full-attention layers: one group, two pages per block (layer indices 0 and 1)."""

    def cache_of(layout, head_size=D):
        spec = FullAttentionSpec(num_kv_heads=H, head_size=head_size, dtype="float32")
        plan = plan_kv_cache({"l0": spec, "l1": spec}, 4 << 20, max_model_len=256, options=PlanOptions(layout=layout))
        return allocate_kv_cache(plan)

    cross, narrow = cache_of("cross_layer"), cache_of("per_layer", 64)
    assert "cross_layer" in ti.pages_copy_reason(cross)
    assert "head_dim 64 is padded to 128" in ti.pages_copy_reason(narrow)
    rng = np.random.default_rng(2)
    for cache in (cross, narrow):
        cache = cache.replace(tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.buffers))
        pages = ti.layer_pages(cache, "l0")
        assert pages.shape == (cache.num_blocks, cache.block_size, 2 * H, 1, D)
        np.testing.assert_array_equal(np.asarray(pages)[..., cache.head_dim :], 0)
        new = jnp.asarray(rng.standard_normal(pages.shape), pages.dtype)
        back = ti.with_layer_pages(cache, "l0", new)
        np.testing.assert_array_equal(
            np.asarray(ti.layer_pages(back, "l0"))[..., : cache.head_dim], new[..., : cache.head_dim]
        )
        np.testing.assert_array_equal(np.asarray(ti.layer_pages(back, "l1")), np.asarray(ti.layer_pages(cache, "l1")))


def test_what_their_kernels_cannot_take_is_refused_by_name():
    cache = allocate_kv_cache(attention_plan("per_layer"))
    with pytest.raises(ti.TpuInferenceMappingError, match=r"pages \(2, 16\) float32 for layer 'full' must be"):
        ti.with_layer_pages(cache, "full", jnp.zeros((2, 16), jnp.float32))
    assert ti.attention_options(cache, "window") == {"sliding_window": 24}
    assert ti.attention_options(cache, "full") == {"sliding_window": None}
    spec = ChunkedLocalAttentionSpec(num_kv_heads=H, head_size=D, dtype="float32", attention_chunk_size=32)
    chunked = allocate_kv_cache(plan_kv_cache({"local": spec}, 1 << 20, max_model_len=64))
    with pytest.raises(ti.TpuInferenceMappingError, match="layer 'local' has spec"):
        ti.attention_options(chunked, "local")


# ---------------------------------------------------------------- their reference kernels


LAYERS = ("full", "window")
FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Their reference unrolls its loop over the sequences: compiled without optimizations, in half the time."""


def their_step(tpu, metas, options, qkv, pages):
    """tpu-inference's reference for each layer in turn over their ``metas``, jitted with the
    metadata as host constants (it loops over the sequences in Python); ``pages`` are every
    layer's (the plan puts both layers at one page position: a block id holds one group's
    layer, so each group writes its own blocks of the one buffer)."""
    fields = {
        layer: [np.asarray(x) for x in (m.seq_lens, m.block_tables, m.query_start_loc, m.request_distribution)]
        for layer, m in metas.items()
    }

    def run(qkv, pages):
        out = {}
        for layer in LAYERS:
            out[layer], pages = tpu.ref_ragged_paged_attention(
                *qkv[layer], pages, *fields[layer], sm_scale=D**-0.5, **options[layer]
            )
        return out, pages

    return jax.jit(run, compiler_options=FAST_COMPILE)(qkv, pages)


@jax.jit
def jaxkv_step(cache, md, qkv):
    """jaxkv's reference for each layer: write the new K/V by the slot mapping, then attend."""
    out = {}
    for layer in LAYERS:
        q, k, v = qkv[layer]
        cache = ops.write_kv(cache, layer, k, v, md, impl="reference")
        out[layer] = ops.paged_attention(q, cache, layer, md, sm_scale=D**-0.5, impl="reference")
    return out, cache


@pytest.mark.slow
def test_their_reference_attention_over_jaxkv_steps_matches_jaxkv(tpu):
    """Per-layer pages (cross-layer ones differ only by the copy tested above)."""
    plan = attention_plan("per_layer")
    mgr = KVCacheManager(plan, max_model_len=256)
    ours = theirs = allocate_kv_cache(plan)
    assert ours.layer_index("full") == ours.layer_index("window") == 0
    rng = np.random.default_rng(0)
    checked = []

    def step(chunks):
        nonlocal ours, theirs
        md, chunks = step_metadata(plan, mgr, chunks)
        real = int(md.cu_q_lens[md.num_seqs[0]])
        qkv = {
            layer: tuple(jnp.asarray(rng.standard_normal((md.num_tokens, n, D)), jnp.float32) for n in (QH, H, H))
            for layer in LAYERS
        }
        want, ours = jaxkv_step(ours, md, qkv)
        metas = {layer: ti.attention_metadata(md, layer) for layer in LAYERS}
        options = {layer: ti.attention_options(theirs, layer) for layer in LAYERS}
        got, pages = their_step(tpu, metas, options, qkv, ti.layer_pages(theirs, "full"))
        theirs = ti.with_layer_pages(theirs, "full", pages)
        for layer in LAYERS:
            np.testing.assert_allclose(np.asarray(got[layer])[:real], np.asarray(want[layer])[:real], rtol=0, atol=2e-6)
        # Their kernel wrote the new K/V itself: the same pages as jaxkv's slot mapping, but
        # in the null block 0, where each wrote its own padding.
        np.testing.assert_array_equal(
            np.asarray(ti.layer_pages(theirs, "full"))[1:], np.asarray(ti.layer_pages(ours, "full"))[1:]
        )
        tables, kv_lens = np.asarray(md.attention_of("window").block_tables), np.asarray(md.kv_lens)
        dropped = sum(int((tables[i, : -(-kv_lens[i] // ours.block_size)] == 0).sum()) for i in range(len(chunks)))
        checked.append(([n for _, n in chunks], dropped))
        for req, n in chunks:
            req.num_computed_tokens += n

    a = Request("a", rng.integers(0, 1000, 70).tolist())
    b = Request("b", rng.integers(0, 1000, 45).tolist())
    step([admit(mgr, a, 40), admit(mgr, b)])  # a chunked prefill; b's window layer drops early blocks
    c = Request("c", a.all_token_ids[:40] + rng.integers(0, 1000, 20).tolist())
    c_chunk = admit(mgr, c)
    assert c.num_computed_tokens == 32, "a prefix hit on the blocks of a's first chunk"
    step([extend(mgr, b, 1, 5), extend(mgr, a, 30), c_chunk])  # a decode before two prefills
    mgr.free(b)  # preempted, as the scheduler does: recompute from its cached blocks
    b.num_computed_tokens = 0
    b_chunk = admit(mgr, b)
    assert b.num_computed_tokens == 32
    step([b_chunk, extend(mgr, a, 1, 6), extend(mgr, c, 1, 7)])
    # (chunk sizes, window blocks already dropped to the null block in the tables their kernel read)
    assert checked == [([40, 45], 0), ([1, 30, 28], 2), ([1, 1, 14], 4)]


NKQ, NV, DK, DV = 1, 2, 8, 8
DIM = 2 * NKQ * DK + NV * DV


@pytest.mark.slow
def test_their_gated_deltanet_reads_and_writes_jaxkv_state_rows(tpu):
    """Their recurrent op reads and writes ``mamba_state_indices``; with :func:`carry_states`
    before each step, a chunked prefill, a checkpoint hit and a decode across a checkpoint
    give exactly one pass over each whole sequence."""
    specs = {
        "attn": FullAttentionSpec(num_kv_heads=1, head_size=D, dtype="float32"),
        "gdn": MambaSpec(shapes=((NV, DK, DV),), dtypes=("float32",), mamba_type="gdn"),
    }
    pool = StatePoolOptions(max_num_seqs=4, checkpoint_bytes=16 * NV * DK * DV * 4)
    plan = plan_kv_cache(
        specs, 2 << 20, max_model_len=256, options=PlanOptions(state_layout="state_pool", state_pool=pool)
    )
    state_groups = tuple(i for i, g in enumerate(plan.groups) if isinstance(g.spec, MambaSpec))
    mgr = KVCacheManager(plan, max_model_len=256)
    states = allocate_state_cache(plan)
    rng = np.random.default_rng(3)
    inputs = jnp.asarray(rng.standard_normal((1000, DIM + 2 * NV)), jnp.float32)  # per token id
    a_log, dt_bias = (jnp.asarray(rng.standard_normal(NV), jnp.float32) for _ in "ad")

    @jax.jit
    def gdn(ids, state, query_start_loc, state_indices, distribution, seq_lens):
        has_initial_state = seq_lens - (query_start_loc[1:] - query_start_loc[:-1]) > 0  # as their v3 metadata
        x = inputs[ids]
        return tpu.ragged_gated_delta_rule(
            x[:, :DIM], x[:, DIM : DIM + NV], x[:, DIM + NV :], state, a_log, dt_bias, query_start_loc,
            state_indices, distribution, has_initial_state, n_kq=NKQ, n_v=NV, d_k=DK, d_v=DV,
        )  # fmt: skip

    @functools.partial(jax.jit, static_argnums=2, compiler_options=FAST_COMPILE)
    def gdn_step(states, md, carry):
        """The recurrent layer's step as their model code runs it, over jaxkv's rows."""
        meta = ti.attention_metadata(md, "gdn")
        if carry:
            states = ti.carry_states(states, md, "gdn")
        (buffer,) = states.layer_states("gdn")
        new, out = gdn(
            md.input_ids,
            buffer,
            meta.query_start_loc,
            meta.mamba_state_indices,
            meta.request_distribution,
            meta.seq_lens,
        )
        return states.with_layer_states("gdn", [new]), out

    outputs: dict[str, dict[int, np.ndarray]] = {}
    moved = []

    def step(chunks, check_carry=False):
        nonlocal states
        md, chunks = step_metadata(plan, mgr, chunks, state_groups=state_groups, num_states=num_state_rows(plan))
        rows = md.states_of("gdn")
        read, write, fresh = (np.asarray(x) for x in (rows.read_rows, rows.write_rows, rows.fresh))
        moved.append(int(np.sum((read != write) & (fresh == 0))))
        if check_carry:  # without the carry a moved state starts from the wrong row
            _, stale = gdn_step(states, md, False)
        states, out = gdn_step(states, md, True)
        out, starts = np.asarray(out), np.asarray(md.cu_q_lens)
        for i, (req, n) in enumerate(chunks):
            for j in range(n):
                outputs.setdefault(req.request_id, {})[req.num_computed_tokens + j] = out[starts[i] + j]
            req.num_computed_tokens += n
        if check_carry:
            assert not np.allclose(np.asarray(stale), out)

    a = Request("a", rng.integers(1, 1000, 110).tolist())
    first = mgr.chunk_limit(a, 0, a.num_tokens)
    step([admit(mgr, a, first)])  # cut at the checkpoint at 96
    step([extend(mgr, a, a.num_tokens - a.num_computed_tokens)])
    b = Request("b", a.all_token_ids[:96] + rng.integers(1, 1000, 9).tolist())
    b_chunk = admit(mgr, b)
    assert b.num_computed_tokens == 96, "resumes from a's state checkpoint"
    step([extend(mgr, a, 1, 7), b_chunk], check_carry=True)
    for token in (8, 9):  # a's state moves to a new row after the checkpoint at 112
        step([extend(mgr, a, 1, token)])
    assert first == 96 and moved == [0, 1, 1, 0, 1]

    for req in (a, b):
        n = req.num_computed_tokens
        ids = jnp.asarray(req.all_token_ids[:n] + [0] * (128 - n))
        state = jnp.zeros((2, NV, DK, DV), jnp.float32)
        _, dense = gdn(
            ids,
            state,
            jnp.asarray([0, n, n, n, n]),
            jnp.asarray([1, 0, 0, 0]),
            jnp.asarray([0, 0, 1]),
            jnp.asarray([n, 0, 0, 0]),
        )
        got = outputs[req.request_id]
        start = min(got)
        np.testing.assert_allclose(
            np.stack([got[p] for p in range(start, n)]), np.asarray(dense)[start:n], rtol=0, atol=1e-6
        )


def test_metadata_of_a_recurrent_layer_and_of_an_attention_layer(tpu):
    specs = {
        "attn": FullAttentionSpec(num_kv_heads=1, head_size=D, dtype="float32"),
        "gdn": MambaSpec(shapes=((NV, DK, DV),), dtypes=("float32",), mamba_type="gdn"),
    }
    plan = plan_kv_cache(specs, 2 << 20, max_model_len=256, options=PlanOptions(state_layout="state_pool"))
    state_groups = tuple(i for i, g in enumerate(plan.groups) if isinstance(g.spec, MambaSpec))
    mgr = KVCacheManager(plan, max_model_len=256)
    req = Request("r", list(range(1, 40)))
    md, _ = step_metadata(plan, mgr, [admit(mgr, req)], state_groups=state_groups, num_states=num_state_rows(plan))
    attn, gdn = ti.attention_metadata(md, "attn"), ti.attention_metadata(md, "gdn")
    write_rows = md.states_of("gdn").write_rows
    np.testing.assert_array_equal(attn.block_tables, md.attention_of("attn").block_tables.reshape(-1))
    assert gdn.block_tables is None
    for meta in (attn, gdn):
        np.testing.assert_array_equal(meta.mamba_state_indices, write_rows)
        np.testing.assert_array_equal(meta.seq_lens, md.kv_lens)
        np.testing.assert_array_equal(meta.query_start_loc, md.cu_q_lens)
        np.testing.assert_array_equal(meta.input_positions, md.positions)
    grouped = ti.grouped_attention_metadata(md)
    assert grouped["attn"] is grouped.groups[0] and grouped["gdn"] is grouped.groups[1]
    states = allocate_state_cache(plan)
    with pytest.raises(GroupKindError):
        ti.carry_states(states, md, "attn")
