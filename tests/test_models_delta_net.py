"""Gated DeltaNet: a serving step's ragged scan resumes each sequence exactly where the
dense, whole-sequence oracle would be, whatever the chunk boundaries."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.errors import JaxkvError
from jaxkv.models.delta_net import (
    DeltaNetError,
    default_form,
    delta_rule_chunk,
    delta_rule_step,
    dense_delta_net_states,
    ragged_delta_net,
    seq_of_token,
)

HEADS, KEY, VALUE, KERNEL = 2, 8, 4, 4
CHANNELS = HEADS * (2 * KEY + VALUE)


def sequence(rng: np.random.Generator, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pre-conv projections, log decays (< 0) and betas of one sequence."""
    mixed = jnp.asarray(rng.standard_normal((length, CHANNELS)), jnp.float32)
    decay = -jnp.asarray(rng.uniform(0.01, 1.0, (length, HEADS)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (length, HEADS)), jnp.float32)
    return mixed, decay, beta


@pytest.fixture(scope="module")
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


FORMS = [("scan", 64), ("chunked", 1), ("chunked", 3), ("chunked", 64)]
"""Each form of the serving step, the chunked one at several chunk sizes."""


@functools.cache
def ragged_step(form: str, chunk_size: int):
    """``ragged_delta_net`` jitted for this file's head sizes, one form and chunk size."""
    return jax.jit(functools.partial(ragged_delta_net, num_heads=HEADS, key_dim=KEY, chunk_size=chunk_size, form=form))


def per_token(state: jax.Array, q, k, v, decay, beta) -> tuple[jax.Array, jax.Array]:
    """The chunk's oracle: one ``delta_rule_step`` after another."""
    return jax.lax.scan(lambda s, x: delta_rule_step(s, *x), state, (q, k, v, decay, beta))


@pytest.mark.parametrize("size", [1, 3, 16])
def test_a_chunk_gives_what_the_per_token_steps_give(size):
    rng = np.random.default_rng(size)
    state = jnp.asarray(rng.standard_normal((HEADS, KEY, VALUE)), jnp.float32)
    q, k = (jnp.asarray(rng.standard_normal((size, HEADS, KEY)) / np.sqrt(KEY), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((size, HEADS, VALUE)), jnp.float32)
    decay = -jnp.asarray(rng.uniform(0.0, 8.0, (size, HEADS)), jnp.float32)  # e^{G} underflows within the chunk
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (size, HEADS)), jnp.float32)
    want_state, want_out = per_token(state, q, k, v, decay, beta)
    got_state, got_out = delta_rule_chunk(state, q, k, v, decay, beta)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-6)


def test_tokens_with_no_decay_and_no_step_leave_a_chunks_state_alone():
    rng = np.random.default_rng(7)
    state = jnp.asarray(rng.standard_normal((HEADS, KEY, VALUE)), jnp.float32)
    q, k = (jnp.asarray(rng.standard_normal((6, HEADS, KEY)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((6, HEADS, VALUE)), jnp.float32)
    decay = -jnp.asarray(rng.uniform(0.1, 1.0, (6, HEADS)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (6, HEADS)), jnp.float32)
    real, _ = delta_rule_chunk(state, q[:4], k[:4], v[:4], decay[:4], beta[:4])
    inert = jnp.zeros((6, HEADS)).at[:4].set(1.0)
    padded, out = delta_rule_chunk(state, q, k, v, decay * inert, beta * inert)
    np.testing.assert_allclose(padded, real, rtol=1e-6, atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(out)))


def serve(seqs, steps, weight, form, *, rows=None, bucket=None, filler=9.0, idle=None):
    """Serve ``seqs`` over ``steps`` (step i: ``steps[i][s]`` new tokens of sequence s,
    packed in row order, then padding tokens of ``filler`` up to ``bucket`` tokens), in
    ``form``, a ``(form, chunk_size)`` pair.

    Returns each sequence's outputs, the padding outputs and the conv and recurrent
    state rows after the last step; rows past the sequences start at ``idle``.
    """
    rows = rows or len(seqs)
    conv = jnp.zeros((rows, KERNEL - 1, CHANNELS))
    state = jnp.zeros((rows, HEADS, KEY, VALUE))
    if idle is not None:
        conv, state = conv.at[len(seqs) :].set(idle[0]), state.at[len(seqs) :].set(idle[1])
    done, outs, pad_outs = [0] * len(seqs), [[] for _ in seqs], []
    for step in steps:
        parts = [
            jax.tree.map(lambda x, s=s, n=n: x[s : s + n], seqs[i])
            for i, (s, n) in enumerate(zip(done, step, strict=True))
        ]
        pad = bucket - sum(step) if bucket else 0
        mixed = jnp.concatenate([p[0] for p in parts] + [jnp.full((pad, CHANNELS), filler)])
        decay = jnp.concatenate([p[1] for p in parts] + [jnp.full((pad, HEADS), filler)])
        beta = jnp.concatenate([p[2] for p in parts] + [jnp.full((pad, HEADS), filler)])
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(step)]), jnp.int32)
        owner = seq_of_token(jnp.pad(cu, (0, rows - len(seqs)), mode="edge"), jnp.array([len(seqs)]), mixed.shape[0])
        out, conv, state = ragged_step(*form)(mixed, decay, beta, weight, owner, conv, state)
        for i, n in enumerate(step):
            outs[i].append(out[int(cu[i]) : int(cu[i]) + n])
        pad_outs.append(out[int(cu[-1]) :])
        done = [s + n for s, n in zip(done, step, strict=True)]
    return [jnp.concatenate(o) for o in outs], jnp.concatenate(pad_outs), conv, state


dense_states = jax.jit(dense_delta_net_states, static_argnums=(4, 5))


def assert_matches_dense(seqs, outs, conv, state, weight, rtol=1e-4):
    for i, (mixed, decay, beta) in enumerate(seqs):
        out, want_conv, want_state = dense_states(mixed[None], decay[None], beta[None], weight, HEADS, KEY)
        np.testing.assert_allclose(outs[i], out[0], rtol=rtol, atol=2e-5, err_msg=f"seq {i} outputs")
        np.testing.assert_allclose(conv[i], want_conv[0], rtol=rtol, atol=1e-6, err_msg=f"seq {i} conv state")
        np.testing.assert_allclose(state[i], want_state[0], rtol=rtol, atol=2e-5, err_msg=f"seq {i} state")


@pytest.mark.parametrize("form", FORMS)
def test_chunks_at_any_boundary_resume_exactly_where_the_dense_pass_is(weight, form):
    rng = np.random.default_rng(3)
    seqs = [sequence(rng, n) for n in (23, 9)]
    # Three steps: a decode shape, odd splits (several chunks, mid-chunk starts), padding.
    outs, _, conv, state = serve(seqs, [(1, 1), (13, 7), (9, 1)], weight, form, bucket=24)
    assert_matches_dense(seqs, outs, conv, state, weight)


@pytest.mark.parametrize("form", [("scan", 64), ("chunked", 3)])
def test_padding_tokens_change_nothing_even_when_not_finite(weight, form):
    rng = np.random.default_rng(5)
    seqs = [sequence(rng, n) for n in (1, 11, 5)]
    steps = [(1, 6, 1), (0, 5, 4)]  # a decode, a prefill over two 3-token chunks, a one-token prefill
    clean, _, conv, state = serve(seqs, steps, weight, form)
    dirty, pad_out, dirty_conv, dirty_state = serve(seqs, steps, weight, form, bucket=16, filler=jnp.nan)
    for a, b in zip(clean, dirty, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dirty_conv, conv, rtol=1e-6)
    np.testing.assert_allclose(dirty_state, state, rtol=1e-6, atol=1e-7)
    assert not np.any(pad_out)


@pytest.mark.parametrize(
    "bad, needle", [({"chunk_size": 0}, "chunk_size must be >= 1, got 0"), ({"form": "wy"}, "got 'wy'")]
)
def test_a_chunk_size_below_one_or_an_unknown_form_is_refused(weight, bad, needle):
    rng = np.random.default_rng(0)
    mixed, decay, beta = sequence(rng, 3)
    with pytest.raises(DeltaNetError, match=needle) as refused:
        ragged_delta_net(
            mixed, decay, beta, weight, jnp.zeros(3, jnp.int32), jnp.zeros((1, KERNEL - 1, CHANNELS)),
            jnp.zeros((1, HEADS, KEY, VALUE)), HEADS, KEY, **bad,
        )  # fmt: skip
    assert isinstance(refused.value, JaxkvError) and isinstance(refused.value, ValueError)


def test_the_cpu_runs_the_scan_and_an_accelerator_the_chunked_form():
    assert default_form() == ("scan" if jax.default_backend() == "cpu" else "chunked")


@st.composite
def ragged_runs(draw):
    """1-3 sequences of 1-20 tokens, each cut into up to 3 steps (0-token pieces allowed),
    and a form."""
    lengths = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
    cuts = [sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2))) for n in lengths]
    steps = [
        tuple(c[0] for c in cuts),
        tuple(c[1] - c[0] for c in cuts),
        tuple(n - c[1] for n, c in zip(lengths, cuts, strict=True)),
    ]
    return lengths, steps, draw(st.sampled_from([("scan", 64), ("chunked", 1), ("chunked", 3), ("chunked", 8)]))


@settings(max_examples=12, deadline=None)
@given(ragged_runs(), st.integers(0, 2**16))
def test_random_ragged_splits_give_the_dense_outputs_and_states(weight, run, seed):
    lengths, steps, form = run
    rng = np.random.default_rng(seed)
    seqs = [sequence(rng, n) for n in lengths]
    idle = (
        jnp.asarray(rng.standard_normal((KERNEL - 1, CHANNELS))),
        jnp.asarray(rng.standard_normal((HEADS, KEY, VALUE))),
    )
    outs, pad_out, conv, state = serve(seqs, steps, weight, form, rows=4, bucket=64, filler=jnp.nan, idle=idle)
    assert_matches_dense(seqs, outs, conv, state, weight)
    np.testing.assert_array_equal(conv[len(seqs) :], jnp.broadcast_to(idle[0], conv[len(seqs) :].shape))
    np.testing.assert_array_equal(state[len(seqs) :], jnp.broadcast_to(idle[1], state[len(seqs) :].shape))
    assert not np.any(pad_out)


@pytest.mark.parametrize("form", [("scan", 64), ("chunked", 4)])
def test_grouped_value_heads_read_their_key_heads_q_and_k(weight, form):
    """Qwen3-Next's layout: each of the ``HEADS`` q/k heads serves two consecutive value
    heads, which is the ungrouped layer with every q/k head repeated."""
    rng = np.random.default_rng(7)
    value_heads, length = 2 * HEADS, 11
    qk = rng.standard_normal((length, 2, HEADS, KEY)).astype(np.float32)
    v = rng.standard_normal((length, value_heads * VALUE)).astype(np.float32)
    decay = -jnp.asarray(rng.uniform(0.01, 1.0, (length, value_heads)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (length, value_heads)), jnp.float32)
    grouped = jnp.asarray(np.concatenate([qk.reshape(length, -1), v], axis=-1))
    repeated = jnp.asarray(np.concatenate([np.repeat(qk, 2, axis=2).reshape(length, -1), v], axis=-1))
    channels = (grouped.shape[-1], repeated.shape[-1])
    conv_weight = jnp.asarray(rng.standard_normal((KERNEL, channels[1])) * 0.5, jnp.float32)
    # The same taps for a channel whichever layout: q/k channels of a repeated head share their weight.
    qk_taps = conv_weight[:, : 2 * value_heads * KEY].reshape(KERNEL, 2, HEADS, 2, KEY)[:, :, :, 0]
    grouped_weight = jnp.concatenate([qk_taps.reshape(KERNEL, -1), conv_weight[:, 2 * value_heads * KEY :]], axis=1)
    conv_weight = jnp.concatenate(
        [jnp.repeat(qk_taps, 2, axis=2).reshape(KERNEL, -1), conv_weight[:, 2 * value_heads * KEY :]], axis=1
    )
    want = dense_delta_net_states(repeated[None], decay[None], beta[None], conv_weight, value_heads, KEY)[0][0]
    out, _, state = ragged_delta_net(
        grouped, decay, beta, grouped_weight, jnp.zeros(length, jnp.int32), jnp.zeros((1, KERNEL - 1, channels[0])),
        jnp.zeros((1, value_heads, KEY, VALUE)), HEADS, KEY, num_value_heads=value_heads, form=form[0],
        chunk_size=form[1],
    )  # fmt: skip
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
    assert state.shape == (1, value_heads, KEY, VALUE)
