"""Mamba-2: a serving step's ragged scan resumes each sequence exactly where the dense,
whole-sequence oracle would be, whatever the chunk boundaries and the padding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.errors import JaxkvError
from jaxkv.models.delta_net import seq_of_token
from jaxkv.models.mamba2 import Mamba2Dims, Mamba2Error, dense_mixer, ragged_mixer, ssd_step

DIMS = Mamba2Dims(num_heads=4, head_dim=3, num_groups=2, state_size=5, conv_kernel=4, dt_min=0.01)
HIDDEN = 8


@pytest.fixture(scope="module")
def params() -> dict:
    rng = np.random.default_rng(0)

    def draw(*shape: int, scale: float = 1.0) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return {
        "in_proj": draw(HIDDEN, DIMS.inner + DIMS.conv_dim + DIMS.num_heads, scale=HIDDEN**-0.5),
        "conv_weight": draw(DIMS.conv_kernel, DIMS.conv_dim, scale=0.5),
        "conv_bias": draw(DIMS.conv_dim, scale=0.5),
        "dt_bias": draw(DIMS.num_heads),
        "a_log": jnp.log(jnp.asarray(rng.uniform(1, 16, DIMS.num_heads), jnp.float32)),
        "d": draw(DIMS.num_heads),
        "norm": 1 + draw(DIMS.inner, scale=0.3),
        "out_proj": draw(DIMS.inner, HIDDEN, scale=DIMS.inner**-0.5),
    }


def test_one_token_decays_the_state_and_adds_dt_x_b():
    state = jnp.ones((1, 1, 2))
    new, y = ssd_step(
        state, jnp.array([[2.0]]), jnp.array([0.5]), jnp.array([-2.0]), jnp.array([[1.0, 0.0]]), jnp.array([[1.0, 1.0]])
    )
    decay = np.exp(-1.0)
    np.testing.assert_allclose(new[0, 0], [decay + 1.0, decay], rtol=1e-6)  # + dt * x * B = 0.5 * 2 * [1, 0]
    np.testing.assert_allclose(y[0], [2 * decay + 1.0], rtol=1e-6)  # S C


def test_heads_must_split_into_the_groups():
    with pytest.raises(Mamba2Error, match="num_groups=3") as err:
        Mamba2Dims(num_heads=4, head_dim=3, num_groups=3, state_size=5, conv_kernel=4)
    assert isinstance(err.value, JaxkvError)


@functools.cache
def ragged_step():
    return jax.jit(functools.partial(ragged_mixer, dims=DIMS))


def run_in_chunks(params: dict, xs: list[np.ndarray], cuts: list[list[int]], bucket: int) -> list[np.ndarray]:
    """Feed each sequence's tokens through consecutive ragged steps (one chunk of every
    sequence per step, NaN padding tokens up to ``bucket``: one compiled shape); the
    outputs per sequence."""
    num_seqs = len(xs)
    conv = jnp.zeros((num_seqs, DIMS.conv_kernel - 1, DIMS.conv_dim), jnp.float32)
    ssm = jnp.zeros((num_seqs, DIMS.num_heads, DIMS.head_dim, DIMS.state_size), jnp.float32)
    outs: list[list[np.ndarray]] = [[] for _ in xs]
    for step in range(len(cuts[0]) - 1):
        pieces = [x[c[step] : c[step + 1]] for x, c in zip(xs, cuts, strict=True)]
        lens = [len(p) for p in pieces]
        packed = np.concatenate([*pieces, np.full((bucket - sum(lens), HIDDEN), np.nan, np.float32)])
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        owner = seq_of_token(cu, jnp.array([num_seqs]), packed.shape[0])
        out, conv, ssm = ragged_step()(params, jnp.asarray(packed), owner, conv, ssm)
        out = np.asarray(out)
        assert np.all(out[sum(lens) :] == 0) and np.isfinite(out).all()
        for s, start in enumerate(np.cumsum([0, *lens[:-1]])):
            outs[s].append(out[start : start + lens[s]])
    return [np.concatenate(o) for o in outs]


def test_ragged_steps_in_any_chunks_give_the_dense_outputs(params):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((length, HIDDEN)).astype(np.float32) for length in (9, 1, 6)]
    cuts = [[0, 4, 5, 9], [0, 1, 1, 1], [0, 0, 2, 6]]  # prefill chunks, decodes, a late start
    got = run_in_chunks(params, xs, cuts, bucket=12)
    for x, out in zip(xs, got, strict=True):
        want = dense_mixer(params, jnp.asarray(x[None]), DIMS)[0][0]
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_the_dense_states_are_those_a_ragged_step_leaves(params):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, HIDDEN)).astype(np.float32)
    _, conv, ssm = dense_mixer(params, jnp.asarray(x[None]), DIMS)
    zero_conv = jnp.zeros((1, DIMS.conv_kernel - 1, DIMS.conv_dim), jnp.float32)
    zero_ssm = jnp.zeros((1, DIMS.num_heads, DIMS.head_dim, DIMS.state_size), jnp.float32)
    _, conv2, ssm2 = ragged_step()(params, jnp.asarray(x), jnp.zeros(7, jnp.int32), zero_conv, zero_ssm)
    np.testing.assert_allclose(conv2, conv, rtol=1e-6)
    np.testing.assert_allclose(ssm2, ssm, rtol=1e-5, atol=1e-6)
