"""The Mamba-2 (SSD) mixer, as pure JAX functions: whole sequences and a serving step.

Per head ``h`` (``H`` heads of ``P`` channels, a state of ``N`` per channel), with
``dt_t = clip(softplus(dt_raw_t + dt_bias))`` and ``A = -exp(A_log) < 0``:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D x_t

where ``x (P,)`` is the head's slice of the convolved input and ``B``, ``C (N,)`` come
from the head's group (``G`` groups, each shared by ``H / G`` consecutive heads). The
input ``[x | B | C]`` passes a causal depthwise convolution (kernel ``K``, with a bias)
and SiLU first, whose state is its last ``K - 1`` inputs; the output is gated,
``norm(y * silu(z))`` with an RMSNorm over each group's channels, and projected back.

The mixer's weights (a dict, kernels ``(in, out)``): ``in_proj (D, H P + C + H)``
giving ``[z | xBC | dt_raw]`` with ``C = H P + 2 G N``, ``conv_weight (K, C)``,
``conv_bias (C,)``, ``dt_bias``/``a_log``/``d (H,)``, ``norm (H P,)``, ``out_proj (H P, D)``.

Two forms of the recurrence:

- :func:`dense_mixer`: whole sequences from zero state (the oracle);
- :func:`ragged_mixer`: a serving step's packed tokens of several sequences (decodes
  first, then prefill chunks), each resuming from its own conv and SSM state (its
  rows in a :class:`~jaxkv.device.state_cache.StateCache`) and returning the states after its
  last token; a scan over the packed tokens (the form a CPU runs best; a chunked SSD
  form is not built).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.models.delta_net import dense_causal_conv, ragged_causal_conv, scan_rows, sequence_starts

_HIGHEST = jax.lax.Precision.HIGHEST


class Mamba2Error(JaxkvError, ValueError):
    """A Mamba-2 mixer got bad dimensions (the message names them)."""


@dataclass(frozen=True)
class Mamba2Dims:
    """Sizes of a Mamba-2 mixer and its time-step range ``[dt_min, dt_max]``."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    norm_eps: float = 1e-5
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_groups", "state_size"):
            check_int(name, getattr(self, name), minimum=1, error=Mamba2Error)
        check_int("conv_kernel", self.conv_kernel, minimum=2, error=Mamba2Error)
        if self.num_heads % self.num_groups:
            raise Mamba2Error(f"num_heads={self.num_heads} must be a multiple of num_groups={self.num_groups}")

    @property
    def inner(self) -> int:
        """Channels of ``x`` (and of the gate ``z``): ``H P``."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution sees: ``x``, ``B`` and ``C``."""
        return self.inner + 2 * self.num_groups * self.state_size


def ssd_step(
    state: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token: ``state (H, P, N)``, ``x (H, P)``, ``dt``/``a (H,)``, ``b``/``c (H, N)``;
    returns the new state and ``y = S C (H, P)`` (before the ``D`` skip), float32."""
    state = state * jnp.exp(dt * a)[:, None, None] + (dt[:, None] * x)[:, :, None] * b[:, None, :]
    return state, jnp.einsum("hpn,hn->hp", state, c, precision=_HIGHEST)


def _split_conv(conv: jax.Array, dims: Mamba2Dims) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Convolved ``(..., C)`` -> ``x (..., H, P)``, ``B``/``C (..., H, N)`` (each head its group's), float32."""
    lead = conv.shape[:-1]
    x, b, c = jnp.split(conv.astype(jnp.float32), [dims.inner, dims.inner + dims.num_groups * dims.state_size], -1)
    per_group = dims.num_heads // dims.num_groups
    b, c = (jnp.repeat(t.reshape(*lead, dims.num_groups, dims.state_size), per_group, axis=-2) for t in (b, c))
    return x.reshape(*lead, dims.num_heads, dims.head_dim), b, c


def _projections(params: dict, x: jax.Array, dims: Mamba2Dims) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x (..., D)`` -> the gate ``z (..., H P)``, the conv input ``(..., C)`` and ``dt (..., H)`` (float32)."""
    projected = jnp.matmul(x, params["in_proj"], precision=_HIGHEST)
    z, xbc, dt_raw = jnp.split(projected, [dims.inner, dims.inner + dims.conv_dim], axis=-1)
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32))
    return z, xbc, jnp.clip(dt, dims.dt_min, dims.dt_max)


def _output(params: dict, y: jax.Array, x: jax.Array, z: jax.Array, dims: Mamba2Dims, dtype: jnp.dtype) -> jax.Array:
    """``y + D x`` (heads ``(..., H, P)``) gated by ``silu(z)``, group-RMS-normed, projected out."""
    y = y + params["d"].astype(jnp.float32)[:, None] * x
    gated = y.reshape(*z.shape) * jax.nn.silu(z.astype(jnp.float32))
    groups = gated.reshape(*z.shape[:-1], dims.num_groups, -1)
    normed = groups * jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + dims.norm_eps)
    normed = (normed.reshape(z.shape) * params["norm"].astype(jnp.float32)).astype(dtype)
    return jnp.matmul(normed, params["out_proj"], precision=_HIGHEST)


def _decay_rate(params: dict) -> jax.Array:
    """``A = -exp(A_log) (H,)``, float32."""
    return -jnp.exp(params["a_log"].astype(jnp.float32))


def dense_mixer(params: dict, x: jax.Array, dims: Mamba2Dims) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mixer over whole sequences ``x (B, L, D)`` from zero state: its output
    ``(B, L, D)`` and the states after each sequence, conv ``(B, K-1, C)`` and SSM ``(B, H, P, N)``."""
    z, xbc, dt = _projections(params, x, dims)
    conv, conv_state = dense_causal_conv(xbc, params["conv_weight"], params["conv_bias"])
    xs, b, c = _split_conv(conv, dims)
    a = _decay_rate(params)

    def one_sequence(xs: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        init = jnp.zeros((dims.num_heads, dims.head_dim, dims.state_size), jnp.float32)
        return jax.lax.scan(lambda s, t: ssd_step(s, t[0], t[1], a, t[2], t[3]), init, (xs, dt, b, c))

    ssm_state, y = jax.vmap(one_sequence)(xs, dt, b, c)
    return _output(params, y, xs, z, dims, x.dtype), conv_state, ssm_state


def ragged_mixer(
    params: dict,
    x: jax.Array,
    seq_of_token: jax.Array,
    conv_state: jax.Array,
    ssm_state: jax.Array,
    dims: Mamba2Dims,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One serving step of the mixer: output ``(T, D)`` and the sequences' states after it.

    ``x (T, D)`` the packed tokens; ``seq_of_token (T,)`` the sequence of each token
    (each sequence's tokens contiguous, in sequence order), ``S`` for padding (see
    :func:`jaxkv.models.delta_net.seq_of_token`); ``conv_state (S, K-1, C)`` and
    ``ssm_state (S, H, P, N)`` each sequence's states before the step (zeros for a fresh
    one). Padding tokens change no state; their outputs are zero.
    """
    num_seqs = conv_state.shape[0]
    if x.shape[0] == 0:
        return jnp.zeros((0, params["out_proj"].shape[1]), x.dtype), conv_state, ssm_state
    z, xbc, dt = _projections(params, x, dims)
    starts = sequence_starts(seq_of_token, num_seqs)
    conv, conv_state = ragged_causal_conv(xbc, params["conv_weight"], starts, conv_state, params["conv_bias"])
    real = seq_of_token < num_seqs
    xs, b, c = (jnp.where(real[:, None, None], t, 0.0) for t in _split_conv(conv, dims))
    dt = jnp.where(real[:, None], dt, 0.0)
    a = _decay_rate(params)
    ssm, y = scan_rows(
        lambda s, *t: ssd_step(s, t[0], t[1], a, t[2], t[3]),
        ssm_state.astype(jnp.float32),
        (xs, dt, b, c),
        seq_of_token,
    )
    out = _output(params, y, xs, z, dims, x.dtype)
    return jnp.where(real[:, None], out, 0), conv_state, ssm.astype(ssm_state.dtype)
