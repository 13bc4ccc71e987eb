"""Tiny serving models: configs match the cache plan, the dense oracle masks right, paged == dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.device.cache import allocate_kv_cache
from jaxkv.device.mesh import MODEL_AXIS
from jaxkv.device.metadata import Buckets, ScheduledSeq, build_step_metadata
from jaxkv.models.protocol import ServedModel
from jaxkv.models.tiny import (
    MODEL_CONFIGS,
    ModelConfig,
    ModelConfigError,
    TinyLM,
    dense_greedy_generate,
    get_model_config,
    init_params,
    model_names,
)
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.specs import FullAttentionSpec, MambaSpec


def test_tiny_hybrid_is_the_preset_and_gemma_like():
    config = get_model_config("tiny-hybrid")
    assert config.layer_specs() == get_preset("tiny-hybrid")
    assert config.windows == (32, 32, 32, 32, 32, None)
    assert config.attn_soft_cap and config.final_soft_cap and config.qk_norm


def test_tiny_llama_is_full_attention_with_gqa():
    config = get_model_config("tiny-llama")
    specs = config.layer_specs()
    assert list(specs) == [f"layers.{i}" for i in range(config.num_layers)]
    assert all(type(s) is FullAttentionSpec and s.num_kv_heads == 2 for s in specs.values())
    assert config.num_heads == 2 * config.num_kv_heads


def test_tiny_qwen3_next_has_three_delta_nets_to_one_attention_layer():
    config = get_model_config("tiny-qwen3-next")
    specs = list(config.layer_specs().values())
    assert [type(s) for s in specs[:4]] == [MambaSpec] * 3 + [FullAttentionSpec] and specs[4:] == specs[:4]
    assert specs[0].mamba_type == "gated_delta_net" and specs[0].dtypes == ("float32", "float32")
    assert specs[0].shapes == ((3, config.conv_dim), (4, 32, 32))
    pooled = plan_kv_cache(
        config.layer_specs(), 8 << 20, max_model_len=512, options=PlanOptions(state_layout="state_pool")
    )
    paged = plan_kv_cache(
        config.layer_specs(), 8 << 20, max_model_len=512, options=PlanOptions(state_layout="attention_pages")
    )
    assert pooled.hash_block_size == 16 and paged.hash_block_size == 32  # vLLM's rule: a page holds a state


def test_a_tiny_model_is_a_served_model_whose_weights_are_its_params():
    model = TinyLM(get_model_config("tiny-hybrid"), seed=0, name="tiny-hybrid")
    assert isinstance(model, ServedModel) and model.name == "tiny-hybrid" and model.vocab_size == 512
    assert model.layer_specs() == get_preset("tiny-hybrid")
    specs = model.partition_specs()
    assert jax.tree.structure(specs) == jax.tree.structure(model.params)
    attention = "layers.0.self_attn"
    assert model.params[f"{attention}.q_proj.weight"].shape == (4 * 64, 128)  # (out, in), as checkpoints store it
    assert (specs[f"{attention}.q_proj.weight"], specs[f"{attention}.o_proj.weight"]) == (
        P(MODEL_AXIS, None),
        P(None, MODEL_AXIS),
    )
    assert specs["embed_tokens.weight"] == specs["lm_head.weight"] == specs[f"{attention}.q_norm.weight"] == P()
    # Equal architectures are one forward (engines share its compilation), whatever the weights.
    assert model == TinyLM(get_model_config("tiny-hybrid"), seed=1) != TinyLM(get_model_config("tiny-llama"))


def test_the_same_seed_draws_the_same_weights():
    config = get_model_config("tiny-qwen3-next")
    first, again, other = init_params(config, 7), init_params(config, 7), init_params(config, 8)
    assert list(first) == list(other)
    assert all(np.array_equal(first[name], again[name]) for name in first)
    different = [name for name in first if not np.array_equal(first[name], other[name])]
    assert "layers.0.linear_attn.qkv_proj.weight" in different and "lm_head.weight" in different
    # Norms start at one and the delta rule's decay parameters are fixed, whatever the seed.
    assert all(name.endswith(("norm.weight", "A_log", "dt_bias")) for name in set(first) - set(different))
    assert first["layers.0.linear_attn.A_log"].dtype == jnp.float32
    with pytest.raises(ModelConfigError, match="seed must be a non-negative int, got -1"):
        init_params(config, -1)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_heads": 3}, "num_heads=3 must be a multiple of num_kv_heads=2"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"windows": (8, 0)}, "windows must be"),
        ({"activation": "relu"}, "unknown activation 'relu'; valid: silu, gelu"),
        ({"vocab_size": 0}, "vocab_size must be a positive int, got 0"),
        ({"dtype": "float64"}, "unknown dtype 'float64'"),
        ({"recurrent": (True,)}, "recurrent must be empty or one bool per layer"),
        ({"recurrent": (True, False, False, False), "windows": (8, None, None, None)}, "windows None where True"),
        ({"recurrent": (True,) * 4, "conv_kernel": 1}, "conv_kernel must be an int >= 2, got 1"),
    ],
)
def test_bad_configs_name_the_value(change, match):
    base = MODEL_CONFIGS["tiny-llama"].__dict__
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig(**{**base, **change})
    with pytest.raises(ModelConfigError, match="unknown model 'gpt-5'"):
        get_model_config("gpt-5")


def test_llama_1b_is_a_gpu_model_of_1_1e9_bf16_parameters():
    """Shapes only (jax.eval_shape): the model is never built on a CPU."""
    config = get_model_config("llama-1b")
    assert "llama-1b" in model_names() and "llama-1b" not in MODEL_CONFIGS  # CPU runs iterate MODEL_CONFIGS
    params = jax.tree.leaves(jax.eval_shape(lambda: init_params(config, seed=0)))
    assert {p.dtype for p in params} == {jnp.dtype("bfloat16")}
    assert sum(p.size for p in params) == 1_104_218_112  # 2 x 65.5M embeddings + 16 x 60.8M layers
    assert get_model_config("llama-1b", dtype="float32").dtype == "float32"


def dense(model: TinyLM, tokens: jax.Array) -> jax.Array:
    return jax.jit(model.dense)(model.params, tokens)


def small_config(windows) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, windows=windows
    )


def test_dense_forward_is_causal_and_window_masked():
    model = TinyLM(small_config((8,)), seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 24)), jnp.int32)
    first_changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 64)
    later_changed = tokens.at[0, 20].set((tokens[0, 20] + 1) % 64)
    base, later, first = dense(model, jnp.concatenate([tokens, later_changed, first_changed]))
    np.testing.assert_array_equal(base[:20], later[:20])  # causal
    assert not np.allclose(base[20:], later[20:])
    np.testing.assert_allclose(base[8:], first[8:], rtol=1e-6, atol=1e-6)  # out of the window
    assert not np.allclose(base[1:8], first[1:8])
    full_base, full_first = dense(TinyLM(small_config((None,)), seed=1), jnp.concatenate([tokens, first_changed]))
    assert not np.allclose(full_base[8:], full_first[8:])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_paged_forward_matches_the_dense_forward(name, layout):
    """Two steps of a ragged batch (a chunked prefill, a prefill, then a decode) against dense logits."""
    model = TinyLM(get_model_config(name), seed=3)
    plan = plan_kv_cache(model.config.layer_specs(), 4 << 20, max_model_len=128, options=PlanOptions(layout=layout))
    manager = KVCacheManager(plan, enable_caching=False)
    cache = allocate_kv_cache(plan)
    rng = np.random.default_rng(0)
    a = Request("a", rng.integers(0, 512, 70).tolist())
    b = Request("b", rng.integers(0, 512, 45).tolist())
    buckets = Buckets((128,), (4,), (8,))
    block_sizes = [g.block_size for g in plan.groups]
    forward = jax.jit(lambda params, cache, meta: model.forward(params, cache, meta))

    def run(steps):
        nonlocal cache
        for req, n in steps:
            manager.allocate_slots(req, n)
        seqs = [ScheduledSeq(r.request_id, r.num_computed_tokens, n) for r, n in steps]
        meta = build_step_metadata(
            seqs,
            [r.all_token_ids for r, _ in steps],
            [manager.get_block_ids(r.request_id) for r, _ in steps],
            block_sizes,
            buckets,
            group_layers=[g.layer_names for g in plan.groups],
        )
        logits, cache = forward(model.params, cache, meta)
        for req, n in steps:
            req.num_computed_tokens += n
        return np.asarray(logits)[: len(steps)]

    first = run([(a, 40), (b, 45)])  # b's window layers look back past 32 tokens
    b.append_output_token_ids(int(first[1].argmax()))
    second = run([(b, 1), (a, 30)])
    dense_a, dense_b = dense(model, jnp.asarray([a.all_token_ids, b.all_token_ids + [0] * 24], jnp.int32))
    pairs = [(first[0], dense_a[39]), (first[1], dense_b[44]), (second[0], dense_b[45]), (second[1], dense_a[69])]
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_dense_greedy_generation_is_seeded_and_context_dependent():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 40)]
    model = TinyLM(get_model_config("tiny-hybrid"), seed=0)
    out = dense_greedy_generate(model, prompts, 6)
    assert out == dense_greedy_generate(TinyLM(get_model_config("tiny-hybrid"), seed=0), prompts, 6)
    assert out != dense_greedy_generate(TinyLM(get_model_config("tiny-hybrid"), seed=1), prompts, 6)
    assert [len(o) for o in out] == [6, 6] and len(set(out[1])) > 1
    # Same last token, different history: a different continuation.
    other = dense_greedy_generate(model, [prompts[1][:-1][::-1] + prompts[1][-1:]], 6)
    assert other[0] != out[1]
    with pytest.raises(ModelConfigError, match="max_new_tokens must be a positive int, got 0"):
        dense_greedy_generate(model, prompts, 0)
