"""Model runner: one jitted step per bucket shape, the cache donated and updated in place."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.device.mesh import model_mesh
from jaxkv.device.metadata import Buckets
from jaxkv.device.state_pages import SharedPagesError
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.runner import ModelRunner, RunnerError, default_buckets
from jaxkv.serving.scheduler import Scheduler

BUCKETS = Buckets((4, 64), (4,), (16,))


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(get_model_config("tiny-hybrid"), seed=0)


def setup(model: TinyLM, memory_bytes: int = 2 << 20, layout: str = "cross_layer"):
    plan = plan_kv_cache(
        model.config.layer_specs(),
        memory_bytes,
        max_model_len=256,
        options=PlanOptions(layout=layout, max_num_batched_tokens=64),
    )
    scheduler = Scheduler(KVCacheManager(plan), max_num_seqs=4, max_num_batched_tokens=64)
    return ModelRunner(model, plan, BUCKETS), scheduler


def run(runner: ModelRunner, scheduler: Scheduler) -> int:
    """Step until every request is done; return the number of steps."""
    steps = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out.chunks).tolist())
        steps += 1
    return steps


def test_each_bucket_shape_compiles_once_and_runners_share_them(model):
    runner, scheduler = setup(model, memory_bytes=(2 << 20) + (16 << 10))  # a cache shape of its own
    rng = np.random.default_rng(0)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", rng.integers(0, 512, 20 + 7 * i).tolist()), 12)
    before = runner.cache.buffers
    steps = run(runner, scheduler)
    assert steps >= 12 and runner.num_compilations == 2  # prefill (64 tokens) and decode (4)
    assert all(b.is_deleted() for b in before)  # donated to the step
    for i in range(3, 6):
        scheduler.add_request(Request(f"r{i}", rng.integers(0, 512, 30).tolist()), 20)
    run(runner, scheduler)
    assert runner.num_compilations == 2
    twin, twin_scheduler = setup(model, memory_bytes=(2 << 20) + (16 << 10))
    twin_scheduler.add_request(Request("t", rng.integers(0, 512, 30).tolist()), 3)
    run(twin, twin_scheduler)
    assert twin.num_compilations == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts the CPU backend's memory_analysis figures")
@pytest.mark.parametrize("layout, num_buffers", [("per_layer", 4), ("cross_layer", 1)])
def test_the_cache_is_donated_and_updated_in_place(layout, num_buffers):
    """The step aliases every cache buffer to its output and allocates no cache-sized temp."""
    llama = TinyLM(get_model_config("tiny-llama"), seed=0)  # one group of 4 layer slots
    temps = []
    for memory in (2 << 20, 8 << 20):
        runner, scheduler = setup(llama, memory, layout)
        assert len(runner.cache.buffers) == num_buffers
        scheduler.add_request(Request("a", list(range(40))), 2)
        chunks = scheduler.schedule().chunks
        stats = runner.lower(chunks).compile().memory_analysis()
        cache_bytes = runner.cache.nbytes
        assert stats.alias_size_in_bytes == cache_bytes
        assert stats.output_size_in_bytes < cache_bytes + 4096  # the cache plus the tokens
        temps.append(stats.temp_size_in_bytes)
    assert temps[0] == temps[1]  # 4x the cache, same scratch: no copy of the cache


def test_a_plan_for_other_specs_is_refused(model):
    other = TinyLM(get_model_config("tiny-llama"), seed=0)
    plan = plan_kv_cache(
        {name: get_model_config("tiny-hybrid").layer_specs()["layers.0"] for name in other.config.layer_names},
        1 << 20,
        max_model_len=64,
    )
    with pytest.raises(RunnerError, match=r"layer 'layers.0' needs FullAttentionSpec.*planned for SlidingWindowSpec"):
        ModelRunner(other, plan, BUCKETS)


def test_a_plan_may_pad_heads_up_but_never_down():
    llama = TinyLM(get_model_config("tiny-llama"), seed=0)
    specs = llama.config.layer_specs()  # heads of 64
    tiled = plan_kv_cache(specs, 1 << 20, max_model_len=64, options=PlanOptions(head_dim_multiple=128))
    assert ModelRunner(llama, tiled, BUCKETS).cache.head_dim == 128
    narrow = {name: dataclasses.replace(spec, head_size=32) for name, spec in specs.items()}
    plan = plan_kv_cache(narrow, 1 << 20, max_model_len=64, options=PlanOptions(head_dim_multiple=16))
    with pytest.raises(RunnerError, match=r"head_size=64.*planned for .*head_size=32"):
        ModelRunner(llama, plan, BUCKETS)


def test_default_buckets_give_two_shapes():
    plan = plan_kv_cache(get_model_config("tiny-llama").layer_specs(), 1 << 20, max_model_len=200)
    assert default_buckets(plan, 8, 256) == Buckets((8, 256), (8,), (13,))
    assert default_buckets(plan, 8, 8) == Buckets((8,), (8,), (13,))
    no_len = plan.__class__(num_blocks=plan.num_blocks, groups=plan.groups)
    with pytest.raises(RunnerError, match="max_model_len=None"):
        default_buckets(no_len, 8, 256)


def test_a_model_must_be_served_and_planned_layer_for_layer(model):
    plan = plan_kv_cache(model.config.layer_specs(), 1 << 20, max_model_len=64)
    with pytest.raises(RunnerError, match="dict is not a ServedModel"):
        ModelRunner({"params": 1}, plan, BUCKETS)
    llama = TinyLM(get_model_config("tiny-llama"), seed=0, name="tiny-llama")
    fewer = plan_kv_cache(dict(list(llama.layer_specs().items())[:3]), 1 << 20, max_model_len=64)
    with pytest.raises(RunnerError, match=r"layer 'layers.3' of tiny-llama is in no KV cache group"):
        ModelRunner(llama, fewer, BUCKETS)
    more = plan_kv_cache({**llama.layer_specs(), "extra": llama.layer_specs()["layers.0"]}, 1 << 20, max_model_len=64)
    with pytest.raises(RunnerError, match=r"the plan holds layers \['extra'\] that tiny-llama does not have"):
        ModelRunner(llama, more, BUCKETS)


def test_states_in_kv_pages_need_the_owners_unit_blocks_and_a_mesh_that_keeps_pages_whole():
    qwen = TinyLM(get_model_config("tiny-qwen3-next"), seed=0)
    plan = plan_kv_cache(
        qwen.layer_specs(), 4 << 20, max_model_len=64, options=PlanOptions(state_layout="shared_pages")
    )
    with pytest.raises(RunnerError, match=r"unit_blocks .* is needed exactly when states live in the KV pages"):
        ModelRunner(qwen, plan, BUCKETS)
    manager = KVCacheManager(plan)
    runner = ModelRunner(qwen, plan, BUCKETS, unit_blocks=manager.state_blocks)
    assert runner.state_places([0]) == [(0,)]  # a plain block is a unit of one
    with pytest.raises(SharedPagesError, match="'model' of 2 devices"):
        ModelRunner(qwen, plan, BUCKETS, mesh=model_mesh(2), unit_blocks=manager.state_blocks)
