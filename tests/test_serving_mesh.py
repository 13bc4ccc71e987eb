"""Serving tensor-parallel on a mesh of 1, 2, 4 and 8 CPU devices (tests/conftest.py gives
the CPU backend 8): the same tokens as on one device, nothing compiled after warm-up,
each device holding its share of the KV heads and weights, and the host tier moving
each device's shard of a block."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxkv.core.state_checkpoints import resend_position
from jaxkv.device.cache import KVCacheShardingError
from jaxkv.device.mesh import MeshError, model_mesh
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.offload.transfer import TransferEngine
from jaxkv.planner import PlanOptions, TensorParallelError, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.offload_connector import OffloadConfig

DEVICE_COUNTS = (1, 2, 4, 8)
NEW_TOKENS = 6
MODELS = {"tiny-llama-kv8": DEVICE_COUNTS, "tiny-hybrid-kv8": DEVICE_COUNTS, "tiny-qwen3-next-kv8": (8,)}
"""Device counts each model is checked on (the Gated DeltaNet hybrid, slowest to compile,
on the widest mesh only)."""
ONE_SHAPE = Buckets((64,), (4,), (16,))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 512, n).tolist() for n in (70, 33, 90)]


def build(model: str, num_devices: int | None, memory_bytes: int = 2 << 20, **kwargs) -> Engine:
    mesh = None if num_devices is None else model_mesh(num_devices)
    return Engine.build(
        model,
        memory_bytes=memory_bytes,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        buckets=ONE_SHAPE,
        mesh=mesh,
        **kwargs,
    )


def tokens(result) -> list[list[int]]:
    return [list(o.output_token_ids) for o in result.outputs]


@pytest.mark.parametrize("model", MODELS)
def test_same_tokens_on_1_2_4_8_devices_and_no_compilation_after_warm_up(model, prompts):
    single = tokens(build(model, None).generate(prompts, NEW_TOKENS))
    for n in MODELS[model]:
        # 3 MiB: on a mesh a hybrid's states go to a state pool whose checkpoint share
        # then holds every prompt's resend checkpoint
        eng = build(model, n, memory_bytes=3 << 20)
        first = eng.generate(prompts, NEW_TOKENS)
        again = eng.generate(prompts, NEW_TOKENS)
        assert tokens(first) == tokens(again) == single, n
        assert again.num_compilations == 0
        assert [o.num_cached_tokens for o in again.outputs] == [resend_position(len(p), 16) for p in prompts]
        kv = eng.runner.kv_cache.buffers[0]
        heads = {s.data.shape[-2] for s in kv.addressable_shards}
        assert len(kv.devices()) == n and heads == {2 * 8 // n}  # K and V of 8 / n heads each


def test_weights_follow_their_partition_specs_on_the_mesh():
    eng = build("tiny-llama-kv8", 4)
    params = eng.runner.params
    q, o = params["layers.0.self_attn.q_proj.weight"], params["layers.0.self_attn.o_proj.weight"]
    assert q.addressable_shards[0].data.shape == (128 // 4, 128)  # column-parallel: (out, in) split by out
    assert o.addressable_shards[0].data.shape == (128, 128 // 4)  # row-parallel: split by in
    assert params["layers.0.input_layernorm.weight"].sharding.is_fully_replicated


@pytest.mark.parametrize("num_devices", [4])
def test_host_tier_on_a_mesh_serves_prefix_hits_with_the_same_tokens(prompts, num_devices):
    """A device pool of 24 blocks evicts each prompt before its second turn: the second
    turns load their prefixes back from host, on one device and on the mesh alike."""
    model = TinyLM(get_model_config("tiny-llama-kv8"))
    config = plan_kv_cache(
        model.config.layer_specs(), 24 << 16, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )

    def serve(mesh: Mesh | None) -> tuple[list[list[int]], int]:
        eng = Engine(model, config, max_num_seqs=4, buckets=ONE_SHAPE, offload=OffloadConfig(4 << 20), mesh=mesh)
        out = [tokens(eng.generate([prompt + [7] * 60], NEW_TOKENS))[0] for _ in range(2) for prompt in prompts]
        return out, eng.connector.stats.num_loaded_blocks

    single, single_loaded = serve(None)
    sharded, loaded = serve(model_mesh(num_devices))
    assert sharded == single and loaded == single_loaded > 0


def test_host_buffers_of_a_sharded_cache_round_trips_each_shard():
    runner = build("tiny-qwen3-next-kv8", 4).runner
    sharding = runner.kv_cache.buffers[0].sharding
    data = jax.random.normal(jax.random.key(0), runner.kv_cache.buffers[0].shape, runner.kv_cache.dtype)
    kv = runner.kv_cache.replace([jax.device_put(data, sharding)])
    runner.cache = dataclasses.replace(runner.cache, kv=kv)
    pool = runner.host_buffers(8 << 16, memory_kind="numpy")
    assert len(pool.buffers) == 4 and pool.buffers[0].shape[-2] == 2 * 8 // 4  # one host buffer per device
    assert len(runner.state_host_buffers(1 << 20).buffers) == 1  # states are replicated: one host copy
    transfers = TransferEngine(pool)
    transfers.wait(runner.store_blocks(transfers, [3, 5], [1, 2]))
    np.testing.assert_array_equal(pool.rows([1, 2]), np.asarray(data)[[3, 5]])
    transfers.wait(runner.load_blocks(transfers, [7], [2]))
    after = runner.kv_cache.buffers[0]
    assert after.sharding == sharding
    np.testing.assert_array_equal(np.asarray(after[7]), np.asarray(data)[5])


def test_kv_heads_that_do_not_split_over_the_mesh_are_typed_errors():
    with pytest.raises(TensorParallelError, match=r"num_kv_heads=2 .* tensor_parallel=4"):
        build("tiny-llama", 4)
    model = TinyLM(get_model_config("tiny-llama"))
    config = plan_kv_cache(
        model.config.layer_specs(), 2 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    with pytest.raises(KVCacheShardingError, match=r"num_kv_heads=2 .* size 8"):
        Engine(model, config, mesh=model_mesh(8))
    with pytest.raises(MeshError, match="num_devices=9 exceeds the 8"):
        model_mesh(9)
    with pytest.raises(MeshError, match="'tp' is not an axis"):
        Engine(model, config, mesh=model_mesh(2), model_axis="tp")


def test_a_reallocated_cache_is_sharded_again():
    eng = build("tiny-llama-kv8", 2)
    eng.runner.reallocate_cache()
    assert eng.runner.kv_cache.buffers[0].sharding.spec[-2] == "model"
    assert float(jnp.abs(eng.runner.kv_cache.buffers[0]).sum()) == 0.0
