"""jaxkv.device.auto: what ``auto`` picks on each kind of device and, for paged attention,
for each shape, checked against fake devices (the rule reads only a device's platform
and compute capability), and what the ops then run under ``auto``."""

from __future__ import annotations

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from jaxkv import ops
from jaxkv.device import auto
from jaxkv.device.cache import allocate_kv_cache
from jaxkv.device.metadata import attention_metadata
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec


def device(platform: str, capability: str | None = None) -> types.SimpleNamespace:
    """A fake device: a platform and, for a GPU, a compute capability."""
    fake = types.SimpleNamespace(platform=platform, device_kind=f"fake {platform} {capability}")
    if capability is not None:
        fake.compute_capability = capability
    return fake


H100 = device("gpu", "9.0")
A100 = device("gpu", "8.0")


def shapes(dtype=jnp.bfloat16, *, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 64, block_size: int = 16):
    """q ``(T, QH, D)`` and a per-layer cache buffer ``(N, bs, 2H, D)`` as shapes (llama-1b's by default)."""
    return (
        jax.ShapeDtypeStruct((64, q_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((128, block_size, 2 * kv_heads, head_dim), dtype),
    )


@pytest.mark.parametrize(
    "fake, impl",
    [
        (device("tpu"), "pallas_tpu"),
        (device("gpu", "9.0"), "pallas_gpu"),  # H100, H200
        (device("gpu", "8.0"), "xla_gpu"),  # A100
        (device("gpu", "8.9"), "xla_gpu"),  # L4
        (device("gpu", "10.0"), "xla_gpu"),  # Blackwell: no wgmma
        (device("gpu", "gfx90a"), "xla_gpu"),  # an AMD GPU's architecture name
        (device("gpu"), "xla_gpu"),  # no capability reported
        (device("cpu"), "reference"),
    ],
    ids=["tpu", "hopper", "ampere", "ada", "blackwell", "rocm", "unknown-gpu", "cpu"],
)
def test_each_kind_of_device_gets_its_implementation_with_a_reason(fake, impl):
    choice = auto.device_choice(fake)
    assert choice.impl == impl
    assert choice.reason


def test_on_hopper_attention_takes_the_mosaic_kernel_for_the_shapes_it_fits():
    choice = auto.attention_choice(*shapes(), device=H100)
    assert choice == ("pallas_gpu", "Hopper GPU (compute capability 9.0): the Mosaic GPU kernel")
    assert auto.attention_choice(*shapes(jnp.float16, q_heads=8, kv_heads=8, head_dim=128), device=H100).impl == (
        "pallas_gpu"
    )


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"dtype": jnp.float32}, "bf16 or fp16"),
        ({"q_heads": 24, "kv_heads": 8}, "must divide 64"),  # 3 query heads per KV head
        ({"head_dim": 8}, "head_dim 8 must be a multiple of 64"),
    ],
    ids=["fp32", "gqa3", "head-dim-8"],
)
def test_on_hopper_shapes_the_kernel_does_not_take_fall_back_to_xla_saying_why(kwargs, why):
    choice = auto.attention_choice(*shapes(**kwargs), device=H100)
    assert choice.impl == "xla_gpu"
    assert why in choice.reason


def test_a_cache_split_over_a_mesh_falls_back_to_xla():
    mesh = AbstractMesh((2,), ("model",), axis_types=(AxisType.Auto,))
    q, kv = shapes()
    split = jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=NamedSharding(mesh, PartitionSpec(None, None, "model")))
    choice = auto.attention_choice(q, split, device=H100)
    assert choice == ("xla_gpu", "the cache is split over 2 devices; the Mosaic GPU kernel runs on one")


def test_off_hopper_attention_follows_the_device():
    assert auto.attention_choice(*shapes(), device=A100).impl == "xla_gpu"
    assert auto.attention_choice(*shapes(), device=device("tpu")).impl == "pallas_tpu"
    assert auto.attention_choice(*shapes(), device=device("cpu")).impl == "reference"


def test_each_shape_is_decided_once_and_logged_once(caplog):
    q, kv = shapes(head_dim=192)  # a shape no other test asks about
    with caplog.at_level(logging.INFO, logger="jaxkv.device.auto"):
        first = auto.attention_choice(q, kv, device=H100)
        again = auto.attention_choice(q, kv, device=H100)
    assert first is again
    logged = [r.getMessage() for r in caplog.records if "auto paged attention" in r.getMessage()]
    assert len(logged) == 1
    assert "pallas_gpu" in logged[0] and "(64, 32, 192) bfloat16" in logged[0]


# ------------------------------------------------------------- the ops under ``auto`` on a fake Hopper GPU

META = attention_metadata(
    ("a",),
    [[2, 3], [4, 0], [0, 0]],  # block tables
    [27, 3, 0],  # kv lens
    [0, 1, 4, 4],  # cu_q_lens: one decode, one 3-token prefill
    [2],  # num_seqs
    num_tokens=8,
)


@pytest.fixture
def hopper(monkeypatch):
    """The ops see a fake H100 as the device in hand (the kernels still run here, interpreted)."""
    monkeypatch.setattr(auto, "default_device", lambda: H100)


def one_layer_cache(rng, dtype, head_dim):
    spec = FullAttentionSpec(num_kv_heads=1, head_size=head_dim, dtype=dtype)
    cache = allocate_kv_cache(KVCacheConfig(num_blocks=6, groups=(KVCacheGroup(("a",), spec, 16),)))
    return cache.replace((jnp.asarray(rng.standard_normal(cache.buffers[0].shape), dtype),))


def attention_runs(monkeypatch) -> list[str]:
    """The implementations whose paged attention the ops call, in order (recorded, then run)."""
    runs: list[str] = []
    for name in ("reference", "xla_gpu", "pallas_gpu"):
        table = dict(ops._DISPATCH[name])
        original = table["paged_attention"]

        def recorded(name=name, original=original):
            runs.append(name)
            return original()

        table["paged_attention"] = recorded
        monkeypatch.setitem(ops._DISPATCH, name, table)
    return runs


@pytest.mark.parametrize(
    "dtype, head_dim, expected",
    [("bfloat16", 64, "pallas_gpu"), ("float32", 64, "xla_gpu"), ("bfloat16", 8, "xla_gpu")],
    ids=["kernel-shapes", "fp32", "head-dim-8"],
)
def test_auto_on_hopper_runs_the_kernel_where_it_fits_and_xla_elsewhere(hopper, monkeypatch, dtype, head_dim, expected):
    assert ops.get_implementation() == "pallas_gpu"
    rng = np.random.default_rng(0)
    cache = one_layer_cache(rng, dtype, head_dim)
    q = jnp.asarray(rng.standard_normal((8, 4, head_dim)), dtype)
    runs = attention_runs(monkeypatch)
    got = ops.paged_attention(q, cache, "a", META, sm_scale=0.125)
    assert runs == [expected]
    want = ops.paged_attention(q, cache, "a", META, sm_scale=0.125, impl="reference")
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tolerance, rtol=tolerance
    )


def test_a_name_overrides_auto_on_hopper(hopper):
    with ops.set_implementation("xla_gpu"):
        assert ops.get_implementation() == "xla_gpu"
    assert ops.implementation_setting() == "auto"
    assert ops.get_implementation("reference") == "reference"
