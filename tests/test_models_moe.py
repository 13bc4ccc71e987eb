"""Sparse MoE: the grouped (ragged_dot) experts give what running each chosen expert on
each token gives, and the routers pick what their rules say."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.moe import routed_experts, sigmoid_group_top_k, softmax_top_k, stack_experts

TOKENS, HIDDEN, WIDTH, EXPERTS, K = 11, 6, 5, 4, 2


def per_token(x, experts, weights, up, down, gate):
    """The oracle: a loop over tokens and their chosen experts."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            h = x[t] @ up[e]
            h = np.asarray(jax.nn.silu(x[t] @ gate[e])) * h if gate is not None else np.asarray(jax.nn.relu(h)) ** 2
            out[t] += weights[t, j] * (h @ down[e])
    return out


def test_grouped_experts_match_a_per_token_loop_gated_or_not():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    up, gate = (rng.standard_normal((EXPERTS, HIDDEN, WIDTH)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((EXPERTS, WIDTH, HIDDEN)).astype(np.float32)
    experts = np.stack([rng.choice(EXPERTS - 1, K, replace=False) for _ in range(TOKENS)])  # expert 3 unused
    weights = rng.uniform(size=(TOKENS, K)).astype(np.float32)
    gated = routed_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), up, down, jax.nn.silu, gate=gate)
    np.testing.assert_allclose(gated, per_token(x, experts, weights, up, down, gate), rtol=1e-5, atol=1e-5)
    plain = routed_experts(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), up, down, lambda h: jax.nn.relu(h) ** 2
    )
    np.testing.assert_allclose(plain, per_token(x, experts, weights, up, down, None), rtol=1e-5, atol=1e-5)


def test_softmax_router_renormalises_the_top_k_when_asked():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    experts, weights = softmax_top_k(logits, 2, normalize=False)
    assert experts.tolist() == [[3, 2]]
    np.testing.assert_allclose(weights, [[0.4, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(softmax_top_k(logits, 2, normalize=True)[1], [[4 / 7, 3 / 7]], rtol=1e-6)


def test_sigmoid_router_picks_within_the_best_group_and_weighs_by_unbiased_scores():
    # Group 0 = experts 0, 1; group 1 = experts 2, 3. Expert 0 alone is the best, but
    # group 1's two best sum higher, so only experts 2 and 3 may be chosen.
    logits = jnp.array([[3.0, -3.0, 1.0, 1.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 0.5])
    experts, weights = sigmoid_group_top_k(logits, 1, bias=bias, num_groups=2, top_groups=1, normalize=False, scale=2.0)
    assert experts.tolist() == [[3]]  # the bias picks 3 over 2
    np.testing.assert_allclose(weights, [[2.0 * float(jax.nn.sigmoid(1.0))]], rtol=1e-6)  # unbiased score, scaled


def test_experts_stored_one_by_one_are_stacked_once_in_the_grouped_layout():
    rng = np.random.default_rng(1)
    stored = {f"mlp.experts.{e}.up_proj.weight": jnp.asarray(rng.standard_normal((WIDTH, HIDDEN))) for e in range(3)}
    stored["mlp.gate.weight"] = jnp.zeros((3, HIDDEN))
    stacked = stack_experts(stored, "mlp.experts", 3, ["up_proj"])
    assert sorted(stacked) == ["mlp.experts.up_proj", "mlp.gate.weight"]
    assert stacked["mlp.experts.up_proj"].shape == (3, HIDDEN, WIDTH)  # (E, in, out)
    np.testing.assert_array_equal(stacked["mlp.experts.up_proj"][2], stored["mlp.experts.2.up_proj.weight"].T)
    assert stack_experts(stacked, "mlp.experts", 3, ["up_proj"]) == stacked  # already stacked: unchanged
