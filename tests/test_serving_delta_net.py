"""Gated DeltaNet: a serving step's ragged scan resumes each sequence exactly where the
dense, whole-sequence oracle would be, whatever the chunk boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.serving.delta_net import delta_rule_step, dense_delta_net, ragged_delta_net, seq_of_token

HEADS, KEY, VALUE, KERNEL = 2, 8, 4, 4
CHANNELS = HEADS * (2 * KEY + VALUE)


def sequence(rng: np.random.Generator, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pre-conv projections, log decays (< 0) and betas of one sequence."""
    mixed = jnp.asarray(rng.standard_normal((length, CHANNELS)), jnp.float32)
    decay = -jnp.asarray(rng.uniform(0.01, 1.0, (length, HEADS)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (length, HEADS)), jnp.float32)
    return mixed, decay, beta


@pytest.fixture
def weight() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal((KERNEL, CHANNELS)) * 0.5, jnp.float32)


def test_one_token_moves_the_stored_value_toward_v_by_beta():
    k = jnp.array([[1.0, 0.0]])
    state = jnp.array([[[2.0], [5.0]]])  # value 2 stored under key e0
    new, out = delta_rule_step(state, k, k, jnp.array([[4.0]]), jnp.zeros(1), jnp.array([0.25]))
    np.testing.assert_allclose(new[0, :, 0], [2.5, 5.0])  # 2 + 0.25 * (4 - 2)
    np.testing.assert_allclose(out, [[2.5]])


def test_seq_of_token_marks_padding_with_one_past_the_last_sequence():
    owner = seq_of_token(jnp.array([0, 1, 4, 4, 4]), jnp.array([2]), 6)
    assert owner.tolist() == [0, 1, 1, 1, 4, 4]


def test_chunks_at_any_boundary_resume_exactly_where_the_dense_pass_is(weight):
    rng = np.random.default_rng(3)
    lengths = (23, 9)
    seqs = [sequence(rng, n) for n in lengths]
    dense = [dense_delta_net(m[None], d[None], b[None], weight, HEADS, KEY)[0] for m, d, b in seqs]
    conv = jnp.zeros((2, KERNEL - 1, CHANNELS))
    state = jnp.zeros((2, HEADS, KEY, VALUE))
    # Three steps: (1, 0) tokens, then (13, 8), then (9, 1); a decode shape, odd splits, padding.
    done = [0, 0]
    for step in ((1, 1), (13, 7), (9, 1)):
        parts = [jax.tree.map(lambda x, s=s, n=n: x[s : s + n], seqs[i]) for i, (s, n) in enumerate(zip(done, step))]
        pad = 4
        mixed = jnp.concatenate([p[0] for p in parts] + [jnp.full((pad, CHANNELS), 9.0)])
        decay = jnp.concatenate([p[1] for p in parts] + [jnp.zeros((pad, HEADS))])
        beta = jnp.concatenate([p[2] for p in parts] + [jnp.ones((pad, HEADS))])
        cu = jnp.array([0, step[0], sum(step)])
        owner = seq_of_token(cu, jnp.array([2]), mixed.shape[0])
        out, conv, state = jax.jit(ragged_delta_net, static_argnums=(7, 8))(
            mixed, decay, beta, weight, owner, conv, state, HEADS, KEY
        )
        for i, (s, n) in enumerate(zip(done, step)):
            got = out[sum(step[:i]) : sum(step[:i]) + n]
            np.testing.assert_allclose(got, dense[i][s : s + n], atol=2e-5, err_msg=f"seq {i} tokens {s}..{s + n}")
        done = [s + n for s, n in zip(done, step)]
    assert done == list(lengths)
