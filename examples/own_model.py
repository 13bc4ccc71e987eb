"""Bring your own model: a pure-JAX decoder (plain dict weights, no Flax) of one sliding-window
and one full attention layer, served by jaxkv's Engine with prefix caching, preemption (a
small cache) and a host tier, its tokens checked against its own dense forward."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv import Engine, FullAttentionSpec, OffloadConfig, SlidingWindowSpec, ops

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 4, 2, 16
KV = {"num_kv_heads": KV_HEADS, "head_size": HEAD_DIM, "dtype": "float32"}
LAYERS = {"local": SlidingWindowSpec(**KV, sliding_window=8), "global": FullAttentionSpec(**KV)}


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rope(x, positions):  # x (..., T, heads, HEAD_DIM), rotate-half form
    half = HEAD_DIM // 2
    angles = positions[:, None] * 10_000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    return jnp.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def qkv(p, x, positions):
    q, k, v = jnp.split(rms_norm(x) @ p["qkv"], [HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM], axis=-1)
    q, k = (rope(t.reshape(*t.shape[:-1], -1, HEAD_DIM), positions) for t in (q, k))
    return q, k, v.reshape(*v.shape[:-1], KV_HEADS, HEAD_DIM)


class OwnModel:
    """jaxkv.ServedModel: name, vocab_size, params, layer_specs, partition_specs, forward."""

    name, vocab_size = "own-model", VOCAB

    def __init__(self, seed: int = 0):
        keys = iter(jax.random.split(jax.random.key(seed), 8))
        w = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[0])  # noqa: E731
        layer = lambda: {"qkv": w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": w(HEADS * HEAD_DIM, HIDDEN)}  # noqa: E731
        self.params = {"embed": w(VOCAB, HIDDEN) * 8, "layers": {n: layer() for n in LAYERS}, "head": w(HIDDEN, VOCAB)}

    def layer_specs(self):
        return dict(LAYERS)

    def partition_specs(self):  # replicated; put jaxkv.device.mesh.MODEL_AXIS on split dims for tensor parallelism
        return jax.tree.map(lambda _: PartitionSpec(), self.params)

    def forward(self, params, cache, meta, *, impl=None):
        """One ragged step: the cache supplies each layer's window, the metadata its block table."""
        x = params["embed"][meta.input_ids]
        for name in LAYERS:
            q, k, v = qkv(params["layers"][name], x, meta.positions)
            cache = ops.write_kv(cache, name, k, v, meta, impl=impl)
            out = ops.paged_attention(q, cache, name, meta, sm_scale=HEAD_DIM**-0.5, impl=impl)
            x = x + out.reshape(x.shape[0], -1) @ params["layers"][name]["o"]
        return rms_norm(x[meta.logits_indices]) @ params["head"], cache

    def dense(self, params, tokens):
        """The oracle: causal (window-masked) attention over whole sequences, no cache."""
        x, pos = params["embed"][tokens], jnp.arange(tokens.shape[1])
        for name, spec in LAYERS.items():
            q, k, v = qkv(params["layers"][name], x, pos)
            k, v = (jnp.repeat(t, HEADS // KV_HEADS, axis=2) for t in (k, v))  # query heads grouped by KV head
            mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - getattr(spec, "sliding_window", 1 << 30))
            scores = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5, -jnp.inf)
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
            x = x + out.reshape(*x.shape[:2], -1) @ params["layers"][name]["o"]
        return rms_norm(x) @ params["head"]


def main():
    model, rng = OwnModel(), np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 24).tolist()
    prompts = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (3, 7, 11, 15)]
    engine = Engine(model, memory_bytes=48 << 10, max_model_len=64, max_num_seqs=4, offload=OffloadConfig(1 << 20))
    first, again = (engine.generate(prompts, 8) for _ in range(2))
    # The oracle: greedy tokens of the dense forward, sequences padded to 64 tokens (one compile).
    dense, rows, ends = jax.jit(model.dense), np.arange(len(prompts)), np.array([len(p) for p in prompts])
    tokens = np.array([p + [0] * (64 - len(p)) for p in prompts], np.int32)
    for i in range(8):
        tokens[rows, ends + i] = np.argmax(dense(model.params, tokens)[rows, ends + i - 1], -1)
    want = [tokens[r, e : e + 8].tolist() for r, e in enumerate(ends)]
    same = [list(o.output_token_ids) for o in first.outputs + again.outputs] == want * 2
    loaded = engine.connector.stats.num_loaded_blocks
    print(f"preemptions {first.num_preemptions}, cached {again.num_cached_prompt_tokens}, loaded from host {loaded}")
    print(f"tokens identical to the dense forward: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
