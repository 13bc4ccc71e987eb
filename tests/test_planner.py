"""The planner: groups, unified pages, block sizes, layout, num_blocks; and its CLI."""

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.commands.cli import SizeError, parse_size
from jaxkv.planner import (
    TPU_HEAD_DIM_MULTIPLE,
    BlockPages,
    IncompatibleSpecsError,
    InsufficientMemoryError,
    KVCacheConfig,
    KVCacheGroup,
    PlanError,
    PlanOptions,
    StatePool,
    StatePoolOptions,
    choose_layers_per_group,
    exact_concurrency_bound,
    pad_head_size,
    plan_kv_cache,
)
from jaxkv.presets import get_preset, list_presets
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

GiB = 1 << 30

VLLM_RULE = PlanOptions(state_layout="attention_pages")
"""vLLM's layout for recurrent states: one attention page holds one."""


def check_plan(config: KVCacheConfig, layer_specs, memory_bytes: int) -> None:
    """Invariants every plan keeps."""
    pages = config.pages
    slots = pages.num_layers_per_block
    # Every layer in exactly one group, model order kept inside each group.
    names = [n for g in config.groups for n in g.layer_names]
    assert Counter(names) == Counter(list(layer_specs))
    order = {name: i for i, name in enumerate(layer_specs)}
    for g in config.groups:
        assert 1 <= len(g.layer_names) <= slots
        assert [order[n] for n in g.layer_names] == sorted(order[n] for n in g.layer_names)
        assert all(g.spec.type_key == layer_specs[n].type_key for n in g.layer_names)
    # Slot i of every group is the same memory.
    assert all(len(row) == len(config.groups) for row in pages.layers)
    for gi, g in enumerate(config.groups):
        column = [row[gi] for row in pages.layers]
        assert column == list(g.layer_names) + [None] * (slots - len(g.layer_names))
    # One page size: attention pages equal it, states fit in it.
    for g in config.groups:
        data = g.spec.page_size_bytes(g.block_size)
        if isinstance(g.spec, MambaSpec):
            assert data <= pages.page_size_bytes
        else:
            assert data == pages.page_size_bytes
    smallest = min(g.block_size for g in config.groups)
    assert all(g.block_size % smallest == 0 for g in config.groups)
    assert config.hash_block_size == smallest
    assert pages.block_bytes == pages.page_size_bytes * slots
    assert config.num_blocks * pages.block_bytes <= memory_bytes
    assert config.num_blocks >= sum(config.blocks_per_request()) + 1
    assert config.max_concurrency >= 1


def request_pages(counts, blocks, slots):
    """Slot-pages one max_model_len request occupies with ``slots`` per group."""
    return sum(math.ceil(n / slots) * slots * b for n, b in zip(counts, blocks, strict=False))


# ------------------------------------------------------------ real models


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_plans_at_16_gib_and_32k(name):
    specs = get_preset(name)
    config = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE)
    check_plan(config, specs, 16 * GiB)
    assert "num_blocks" in config.summary()


def test_llama_3_1_8b_is_one_group_of_64_kib_pages():
    config = plan_kv_cache(get_preset("llama-3.1-8b"), 16 * GiB, max_model_len=32768)
    (group,) = config.groups
    assert len(group.layer_names) == 32 and group.block_size == 16
    assert config.pages.page_size_bytes == 65536
    assert config.pages.block_bytes == 32 * 65536
    assert config.num_blocks == 16 * GiB // (32 * 65536) == 8192
    assert config.blocks_per_request() == (2048,)
    assert config.max_concurrency == (8192 - 1) // 2048 == 3


def test_gemma_3_27b_groups_are_equal_sized_with_one_full_group():
    specs = get_preset("gemma-3-27b")
    config = plan_kv_cache(specs, 16 * GiB, max_model_len=32768)
    slots = config.pages.num_layers_per_block
    full = [g for g in config.groups if isinstance(g.spec, FullAttentionSpec)]
    local = [g for g in config.groups if isinstance(g.spec, SlidingWindowSpec)]
    assert len(full) == 1 and len(full[0].layer_names) == 10
    assert len(local) == math.ceil(52 / slots)
    assert all(g.block_size == 16 for g in config.groups)
    # At least as good as vLLM's rule (slots = the smallest type's 10 layers):
    # no more groups, and no more memory per max_model_len request.
    blocks = [local[0].spec.blocks_per_request(32768, 16), 2048]
    assert len(config.groups) <= math.ceil(52 / 10) + 1
    assert request_pages([52, 10], blocks, slots) <= request_pages([52, 10], blocks, 10)
    assert slots == 11  # 5 x 11 sliding + 1 x 11 full: 4 empty slots instead of 8


def test_gpt_oss_splits_into_two_groups_of_18():
    config = plan_kv_cache(get_preset("gpt-oss-120b"), 16 * GiB, max_model_len=32768)
    assert [len(g.layer_names) for g in config.groups] == [18, 18]
    assert config.padding_bytes_per_block == (0, 0)


def test_jamba_grows_attention_blocks_until_a_page_holds_a_mamba_state():
    specs = get_preset("jamba-1.5-mini")
    config = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE)
    state = specs["layers.0"].state_bytes
    attention = next(g for g in config.groups if isinstance(g.spec, FullAttentionSpec))
    page = config.pages.page_size_bytes
    # The smallest multiple of 16 tokens whose 4096 B/token page holds 573,440 B.
    assert attention.block_size % 16 == 0
    assert page >= state > attention.spec.page_size_bytes(attention.block_size - 16)
    assert attention.block_size == 144 and page == 144 * 4096
    mamba = [g for g in config.groups if isinstance(g.spec, MambaSpec)]
    assert len(mamba) == 7 and all(len(g.layer_names) == 4 for g in mamba)
    assert all(g.block_size == attention.block_size for g in mamba)
    # Each Mamba page is padded up to the attention page; the padding is reported.
    padding = dict(zip(config.groups, config.padding_bytes_per_block, strict=False))
    assert all(padding[g] == 4 * (page - state) for g in mamba)
    assert padding[attention] == 0
    assert "padded" in config.summary()


def test_mamba_only_models_use_the_base_block_size_and_the_state_as_page():
    spec = MambaSpec(shapes=((8, 3), (8, 16)), dtypes=("bfloat16", "float32"))
    config = plan_kv_cache({f"m{i}": spec for i in range(3)}, 1 << 20, max_model_len=1000, options=VLLM_RULE)
    (group,) = config.groups
    assert group.block_size == 16 and config.pages.page_size_bytes == spec.state_bytes


def test_smaller_attention_pages_get_proportionally_larger_blocks():
    specs = {
        "full": FullAttentionSpec(num_kv_heads=8, head_size=128),
        "swa": SlidingWindowSpec(num_kv_heads=2, head_size=128, sliding_window=256),
    }
    config = plan_kv_cache(specs, GiB, max_model_len=4096)
    sizes = {g.layer_names[0]: g.block_size for g in config.groups}
    assert sizes == {"full": 16, "swa": 64}
    check_plan(config, specs, GiB)


def test_pages_in_a_non_integer_ratio_are_incompatible():
    specs = {
        "full": FullAttentionSpec(num_kv_heads=8, head_size=128),  # 65,536 B at 16
        "mla": MLASpec(kv_lora_rank=512, qk_rope_head_dim=64),  # 18,432 B at 16
    }
    with pytest.raises(IncompatibleSpecsError, match=r"18432 B.*65536 B"):
        plan_kv_cache(specs, GiB, max_model_len=4096)


# ------------------------------------------------------------ layers per group


@pytest.mark.parametrize(
    "counts, blocks, expected",
    [
        ([32], [2048], 32),  # one type: one group of all layers
        ([52, 10], [577, 2048], 11),  # gemma-3-27b
        ([28, 4], [2, 228], 4),  # jamba: the vLLM choice has no padding
        ([18, 18], [521, 2048], 18),
        ([31, 1], [577, 2048], 1),  # a lone full layer: padding it would waste most
        ([6, 6, 6], [1, 1, 1], 6),
    ],
)
def test_layers_per_group_minimises_request_memory_without_more_groups(counts, blocks, expected):
    assert choose_layers_per_group(counts, blocks) == expected


# --------------------------------------------------------------- num_blocks


def test_too_small_a_budget_names_the_budget_the_need_and_the_length():
    specs = get_preset("llama-3.1-8b")
    need = (2048 + 1) * 32 * 65536  # one 32k request plus the null block
    config = plan_kv_cache(specs, need, max_model_len=32768)
    assert config.num_blocks == 2049 and config.max_concurrency == 1
    with pytest.raises(InsufficientMemoryError) as info:
        plan_kv_cache(specs, need - 1, max_model_len=32768)
    message = str(info.value)
    assert f"memory_bytes={need - 1}" in message and "max_model_len=32768" in message
    assert f"the smallest budget that fits is {need:,} B" in message


def test_num_blocks_override_is_used_but_must_fit_the_budget():
    specs = get_preset("tiny-hybrid")
    config = plan_kv_cache(specs, GiB, max_model_len=64, options=PlanOptions(num_blocks_override=40))
    assert config.num_blocks == 40
    with pytest.raises(InsufficientMemoryError, match="num_blocks_override=100000"):
        plan_kv_cache(specs, 1 << 20, max_model_len=64, options=PlanOptions(num_blocks_override=100_000))
    with pytest.raises(InsufficientMemoryError, match="needs"):
        plan_kv_cache(specs, GiB, max_model_len=64, options=PlanOptions(num_blocks_override=3))


def test_layout_kind_changes_no_byte():
    specs = get_preset("gemma-3-27b")
    cross = plan_kv_cache(specs, 16 * GiB, max_model_len=32768)
    per_layer = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(layout="per_layer"))
    assert per_layer.pages.layout == "per_layer"
    assert per_layer.num_blocks == cross.num_blocks
    assert per_layer.pages.layers == cross.pages.layers


def test_plans_are_deterministic():
    specs = get_preset("qwen3-next-80b")
    assert plan_kv_cache(specs, 8 * GiB, max_model_len=8192, options=VLLM_RULE) == plan_kv_cache(
        specs, 8 * GiB, max_model_len=8192, options=VLLM_RULE
    )


def test_slot_index_finds_the_buffer_of_a_layer():
    config = plan_kv_cache(get_preset("tiny-mamba-hybrid"), 1 << 24, max_model_len=256, options=VLLM_RULE)
    pages = config.pages
    for group in config.groups:
        for i, name in enumerate(group.layer_names):
            assert pages.layer_index(name) == i
    with pytest.raises(KeyError, match="nope"):
        pages.layer_index("nope")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"layer_specs": {}}, "layer_specs"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"memory_bytes": 1.5e9}, "1500000000.0"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "True"),
        ({"layout": "row_major"}, "row_major"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_blocks_override": 0}, "num_blocks_override"),
        ({"layer_specs": {"l0": "full"}}, "'l0'"),
        ({"head_dim_multiple": 0}, "head_dim_multiple must be a positive int, got 0"),
        ({"head_dim_multiple": -1}, "got -1"),
        ({"head_dim_multiple": 2.5}, "got 2.5"),
        ({"head_dim_multiple": "x"}, "got 'x'"),
    ],
)
def test_bad_arguments_raise_a_plan_error_naming_the_value(kwargs, named):
    args = {"layer_specs": get_preset("tiny-hybrid"), "memory_bytes": GiB, "max_model_len": 128} | kwargs
    plan_args = [args.pop("layer_specs"), args.pop("memory_bytes"), args.pop("max_model_len")]
    with pytest.raises(PlanError, match=named):
        plan_kv_cache(*plan_args[:2], max_model_len=plan_args[2], options=PlanOptions(**args))


# ------------------------------------------------------------ tile alignment


def test_a_head_of_64_padded_to_128_lanes_doubles_pages_and_halves_blocks():
    specs = {f"layers.{i}": FullAttentionSpec(num_kv_heads=8, head_size=64) for i in range(32)}
    plain = plan_kv_cache(specs, 8 * GiB, max_model_len=8192)
    tiled = plan_kv_cache(
        specs, 8 * GiB, max_model_len=8192, options=PlanOptions(head_dim_multiple=TPU_HEAD_DIM_MULTIPLE)
    )
    check_plan(tiled, {n: pad_head_size(s, 128) for n, s in specs.items()}, 8 * GiB)
    (group,) = tiled.groups
    assert group.spec == FullAttentionSpec(num_kv_heads=8, head_size=128)
    assert tiled.pages.page_size_bytes == 2 * plain.pages.page_size_bytes == 65536
    assert tiled.num_blocks == plain.num_blocks // 2 == 4096
    assert tiled.blocks_per_request() == plain.blocks_per_request() == (512,)
    # Half of every block is zero head columns, and the summary says so.
    assert tiled.padding_bytes_per_block == (tiled.pages.block_bytes // 2,)
    assert plain.padding_bytes_per_block == (0,)
    summary = tiled.summary()
    assert "multiple of 128" in summary and "(50.0%) holds no data" in summary


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma-3-27b", "deepseek-v3", "jamba-1.5-mini"])
def test_a_multiple_of_1_plans_exactly_as_before(name):
    specs = get_preset(name)
    assert plan_kv_cache(specs, 4 * GiB, max_model_len=4096, options=PlanOptions(head_dim_multiple=1)) == plan_kv_cache(
        specs, 4 * GiB, max_model_len=4096
    )


def test_heads_already_aligned_are_not_padded():
    specs = get_preset("llama-3.1-8b")  # head_size 128
    plain = plan_kv_cache(specs, 16 * GiB, max_model_len=32768)
    tiled = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(head_dim_multiple=128))
    assert tiled.groups == plain.groups and tiled.num_blocks == plain.num_blocks == 8192
    assert tiled.padding_bytes_per_block == (0,)
    assert pad_head_size(specs["layers.0"], 128) is specs["layers.0"]


def test_mamba_states_keep_their_size_while_attention_heads_are_padded():
    specs = get_preset("tiny-mamba-hybrid")  # attention heads of 16
    config = plan_kv_cache(
        specs, 1 << 24, max_model_len=256, options=PlanOptions(head_dim_multiple=128, state_layout="attention_pages")
    )
    check_plan(config, {n: pad_head_size(s, 128) for n, s in specs.items()}, 1 << 24)
    state = specs["layers.0"].state_bytes
    attention = [g for g in config.groups if isinstance(g.spec, FullAttentionSpec)]
    mamba = [g for g in config.groups if isinstance(g.spec, MambaSpec)]
    assert [g.spec.head_size for g in attention] == [128]
    assert all(g.spec == specs["layers.0"] for g in mamba)
    # A padded attention page (32 KiB at block 16) already holds a state: no growth.
    assert attention[0].block_size == 16 and config.pages.page_size_bytes == 16 * 2048
    padding = dict(zip(config.groups, config.padding_bytes_per_block, strict=False))
    page = config.pages.page_size_bytes
    assert all(padding[g] == len(g.layer_names) * (page - state) for g in mamba)
    # Every token of every attention layer carries 2 x 2 heads x (128 - 16) zero floats.
    assert padding[attention[0]] == len(attention[0].layer_names) * 16 * 2 * 2 * 112 * 4


def test_mla_latents_are_not_padded_in_a_mix_with_padded_attention():
    specs = {
        "mla": MLASpec(kv_lora_rank=512, qk_rope_head_dim=64),  # 576: not a multiple of 128
        "full": FullAttentionSpec(num_kv_heads=9, head_size=64),
    }
    plain = plan_kv_cache(specs, GiB, max_model_len=4096)
    tiled = plan_kv_cache(specs, GiB, max_model_len=4096, options=PlanOptions(head_dim_multiple=128))
    mla = {g.layer_names[0]: g for g in tiled.groups}["mla"]
    full = {g.layer_names[0]: g for g in tiled.groups}["full"]
    assert mla.spec == specs["mla"] and mla.spec.head_size == 576
    assert full.spec.head_size == 128
    # The full page doubled (2,304 -> 4,608 B/token), so MLA blocks scale 4x, not 2x.
    blocks = {g.layer_names[0]: g.block_size for g in plain.groups}
    assert (blocks["mla"], mla.block_size) == (32, 64) and full.block_size == 16


# ------------------------------------------------------- hand-built configs


def test_hand_built_configs_need_no_layout():
    spec = FullAttentionSpec(num_kv_heads=1, head_size=1)
    config = KVCacheConfig(num_blocks=11, groups=(KVCacheGroup(("l0",), spec, 16),))
    assert config.pages is None and config.num_usable_blocks == 10
    assert config.max_concurrency is None and config.padding_bytes_per_block is None
    assert config.blocks_per_request(40) == (3,)
    with pytest.raises(PlanError, match="max_model_len"):
        config.blocks_per_request()
    assert "num_blocks 11" in config.summary()


def test_hand_built_configs_are_validated():
    spec = FullAttentionSpec(num_kv_heads=1, head_size=1)
    with pytest.raises(PlanError, match="num_blocks"):
        KVCacheConfig(num_blocks=0, groups=(KVCacheGroup(("a",), spec, 16),))
    with pytest.raises(PlanError, match=r"multiples of the smallest \(16\), got 24"):
        KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), spec, 16), KVCacheGroup(("b",), spec, 24)))
    with pytest.raises(PlanError, match="more than one group"):
        KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), spec, 16),) * 2)
    with pytest.raises(PlanError, match="at least one layer"):
        KVCacheGroup((), spec, 16)
    with pytest.raises(PlanError, match="-16"):
        KVCacheGroup(("a",), spec, -16)
    with pytest.raises(PlanError, match="unknown layout 'x'"):
        BlockPages(layout="x", layers=(("a",),), page_size_bytes=8)
    with pytest.raises(PlanError, match="rectangle"):
        BlockPages(layout="per_layer", layers=(("a", "b"), ("c",)), page_size_bytes=8)
    group = KVCacheGroup(("a",), spec, 16)  # 16 tokens x (K + V) x 2 B = 64 B pages
    too_small = BlockPages("per_layer", (("a",),), 32)
    with pytest.raises(PlanError, match="64 B pages"):
        KVCacheConfig(num_blocks=4, groups=(group,), pages=too_small)
    wrong_layer = BlockPages("per_layer", (("b",),), 64)
    with pytest.raises(PlanError, match="column 0"):
        KVCacheConfig(num_blocks=4, groups=(group,), pages=wrong_layer)


# ------------------------------------------------------------------ property


def attention_specs():
    heads = st.sampled_from([1, 2, 4, 8])
    size = st.sampled_from([16, 32, 64, 128])
    dtype = st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"])
    return st.one_of(
        st.builds(FullAttentionSpec, num_kv_heads=heads, head_size=size, dtype=dtype),
        st.builds(
            SlidingWindowSpec, num_kv_heads=heads, head_size=size, dtype=dtype, sliding_window=st.integers(1, 4096)
        ),
        st.builds(
            ChunkedLocalAttentionSpec,
            num_kv_heads=heads,
            head_size=size,
            dtype=dtype,
            attention_chunk_size=st.sampled_from([64, 100, 1024]),
        ),
        st.builds(MLASpec, kv_lora_rank=st.sampled_from([64, 448, 512]), qk_rope_head_dim=st.just(64), dtype=dtype),
    )


def mamba_specs():
    shape = st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple)
    return st.integers(1, 3).flatmap(
        lambda n: st.builds(
            MambaSpec,
            shapes=st.lists(shape, min_size=n, max_size=n).map(tuple),
            dtypes=st.lists(st.sampled_from(["float32", "bfloat16"]), min_size=n, max_size=n).map(tuple),
        )
    )


@st.composite
def models(draw):
    kinds = draw(st.lists(st.one_of(attention_specs(), mamba_specs()), min_size=1, max_size=4))
    counts = draw(st.lists(st.integers(1, 12), min_size=len(kinds), max_size=len(kinds)))
    layers = [spec for spec, n in zip(kinds, counts, strict=False) for _ in range(n)]
    order = draw(st.permutations(layers))
    return {f"layers.{i}": spec for i, spec in enumerate(order)}


@settings(max_examples=150, deadline=None)
@given(
    specs=models(),
    memory=st.integers(1, 1 << 34),
    max_model_len=st.integers(1, 20000),
    block_size=st.sampled_from([8, 16, 32]),
)
def test_any_mix_plans_equal_slots_and_pages_within_budget(specs, memory, max_model_len, block_size):
    try:
        config = plan_kv_cache(
            specs,
            memory,
            max_model_len=max_model_len,
            options=PlanOptions(block_size=block_size, state_layout="attention_pages"),
        )
    except IncompatibleSpecsError:
        attention = [s for s in specs.values() if not isinstance(s, MambaSpec)]
        pages = {s.page_size_bytes(block_size) for s in attention}
        assert any(max(pages) % p for p in pages)
        return
    except InsufficientMemoryError as err:
        assert f"memory_bytes={memory}" in str(err)
        return
    check_plan(config, specs, memory)
    # Never more groups, nor more memory per request, than vLLM's slot count.
    types = {}
    for spec in specs.values():
        types[spec.type_key] = types.get(spec.type_key, 0) + 1
    smallest = min(types.values())
    assert len(config.groups) <= sum(math.ceil(n / smallest) for n in types.values())
    per_type = {g.spec.type_key: b for g, b in zip(config.groups, config.blocks_per_request(), strict=False)}
    counts = list(types.values())
    blocks = [per_type[k] for k in types]
    assert request_pages(counts, blocks, config.pages.num_layers_per_block) <= request_pages(counts, blocks, smallest)


# ------------------------------------------------------------------ CLI


def test_parse_size_reads_binary_and_decimal_units():
    assert parse_size("16GiB") == 16 * GiB
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size(" 2 kib ") == 2048
    for bad in ("", "GiB", "16 GiBs", "-1GiB", "0", "1e9"):
        with pytest.raises(SizeError, match="memory size"):
            parse_size(bad)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv.commands.plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[1],
    )


@pytest.mark.subprocess
def test_cli_prints_the_plan_table():
    out = run_cli("--preset", "gemma-3-27b", "--memory", "16GiB", "--max-model-len", "32768")
    assert out.returncode == 0, out.stderr
    assert "sliding_window(1024)" in out.stdout and "full_attention" in out.stdout
    assert "num_blocks" in out.stdout and "max concurrency" in out.stdout


@pytest.mark.subprocess
def test_cli_unknown_preset_is_one_line_and_status_2():
    out = run_cli("--preset", "nope", "--memory", "16GiB", "--max-model-len", "32768")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "'nope'" in out.stderr and "gemma-3-27b" in out.stderr


@pytest.mark.subprocess
def test_cli_too_small_budget_is_status_2_and_names_the_smallest_that_fits():
    out = run_cli("--preset", "llama-3.1-8b", "--memory", "1MiB", "--max_model_len=32768")
    assert out.returncode == 2 and "memory_bytes=1048576" in out.stderr
    assert "the smallest budget that fits is 4,297,064,448 B (4.00 GiB)" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.subprocess
def test_cli_pads_heads_to_tiles_on_request():
    args = ("--preset", "gpt-oss-120b", "--memory", "16GiB", "--max-model-len", "32768")
    plain, tiled = run_cli(*args), run_cli(*args, "--head_dim_multiple", "128")
    assert plain.returncode == tiled.returncode == 0, tiled.stderr
    assert "32,768" in plain.stdout and "65,536" in tiled.stdout  # head 64 -> 128: pages x2
    assert "multiple of 128" in tiled.stdout and "multiple of" not in plain.stdout
    bad = run_cli(*args, "--head-dim-multiple", "0")
    assert bad.returncode == 2 and "head_dim_multiple must be a positive int, got 0" in bad.stderr


def test_a_state_pool_needs_recurrent_groups_at_the_hash_block_size():
    full = FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="float32")
    state = MambaSpec(shapes=((4, 3),), dtypes=("float32",))
    attention = KVCacheGroup(("a",), full, 16)
    with pytest.raises(PlanError, match="at least one recurrent"):
        KVCacheConfig(num_blocks=8, groups=(attention,), states=StatePool(num_states=4))
    with pytest.raises(PlanError, match="hash block size 16, got 32"):
        KVCacheConfig(num_blocks=8, groups=(attention, KVCacheGroup(("m",), state, 32)), states=StatePool(num_states=4))
    with pytest.raises(PlanError, match="num_states must be an int >= 2, got 1"):
        StatePool(num_states=1)
    config = KVCacheConfig(
        num_blocks=8, groups=(attention, KVCacheGroup(("m",), state, 16)), states=StatePool(num_states=4)
    )
    assert config.state_group_ids == (1,)
    assert KVCacheConfig(num_blocks=8, groups=(attention, KVCacheGroup(("m",), state, 16))).state_group_ids == ()


def test_exact_concurrency_bound_of_an_attention_only_model_is_bytes_over_request_bytes():
    specs = get_preset("llama-3.1-8b")
    per_token = sum(s.bytes_per_token for s in specs.values())
    assert exact_concurrency_bound(specs, 16 * GiB, 32768) == 16 * GiB // (per_token * 32768)


def test_exact_concurrency_bound_adds_one_live_state_per_request():
    specs = get_preset("nemotron-h-8b")
    per_token = sum(s.bytes_per_token for s in specs.values() if not isinstance(s, MambaSpec))
    state = sum(s.state_bytes for s in specs.values() if isinstance(s, MambaSpec))
    bound = exact_concurrency_bound(specs, 16 * GiB, 32768)
    assert bound == 16 * GiB // (per_token * 32768 + state)
    assert plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE).max_concurrency <= bound


@pytest.mark.parametrize("memory_bytes, max_model_len", [(0, 16), (1024, 0), (1024, True)])
def test_exact_concurrency_bound_refuses_bad_sizes(memory_bytes, max_model_len):
    with pytest.raises(PlanError):
        exact_concurrency_bound(get_preset("llama-3.1-8b"), memory_bytes, max_model_len)


# ------------------------------------------------------------ state pool (issue 9)

RECURRENT_HYBRIDS = {"nemotron-h-8b": 1040, "qwen3-next-80b": 1056, "jamba-1.5-mini": 144}


def check_state_pool_plan(config: KVCacheConfig, layer_specs, memory_bytes: int) -> None:
    """Invariants of every state-pool plan: both pools fit the budget, one request fits both."""
    pool = config.state_pool
    attention = config.num_blocks * config.pages.block_bytes if config.pages is not None else 0
    assert attention + pool.num_states * pool.state_bytes <= memory_bytes
    assert config.num_blocks >= config.attention_blocks_per_request() + 1
    assert pool.num_live_states >= len(config.state_group_ids)
    assert config.max_concurrency >= 1
    # Each Mamba type is one group at the hash block size; pages list attention groups only.
    recurrent = [config.groups[i] for i in config.state_group_ids]
    assert {g.spec.type_key for g in recurrent} == {
        s.type_key for s in layer_specs.values() if isinstance(s, MambaSpec)
    }
    assert all(g.block_size == config.hash_block_size for g in recurrent)
    assert pool.state_bytes == max(len(g.layer_names) * g.spec.state_bytes for g in recurrent)
    if config.pages is not None:
        on_pages = {n for row in config.pages.layers for n in row if n is not None}
        assert on_pages == {n for g in config.attention_groups for n in g.layer_names}
    names = [n for g in config.groups for n in g.layer_names]
    assert Counter(names) == Counter(list(layer_specs))


@pytest.mark.parametrize("name, vllm_block", RECURRENT_HYBRIDS.items())
def test_a_state_pool_caches_prefixes_at_16_tokens_where_vllms_rule_needs_a_page_per_state(name, vllm_block):
    specs = get_preset(name)
    pooled = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(state_layout="state_pool"))
    paged = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE)
    assert paged.hash_block_size == vllm_block
    assert pooled.hash_block_size == 16
    assert all(g.block_size == 16 for g in pooled.groups)
    check_state_pool_plan(pooled, specs, 16 * GiB)


@pytest.mark.parametrize("name", RECURRENT_HYBRIDS)
def test_a_state_pool_reaches_98_percent_of_the_exact_concurrency_bound(name):
    specs = get_preset(name)
    bound = exact_concurrency_bound(specs, 16 * GiB, 32768)
    pooled = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(state_layout="state_pool"))
    assert bound >= pooled.max_concurrency >= 0.98 * bound
    assert (
        pooled.max_concurrency >= plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE).max_concurrency
    )


def test_nemotron_h_8b_runs_26_requests_on_a_state_pool_and_22_on_attention_pages():
    specs = get_preset("nemotron-h-8b")
    assert exact_concurrency_bound(specs, 16 * GiB, 32768) == 26
    assert plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=VLLM_RULE).max_concurrency == 22
    pooled = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(state_layout="state_pool"))
    assert pooled.max_concurrency == 26
    assert pooled.state_pool.num_live_states == 26 and pooled.state_pool.num_checkpoint_states == 0
    # One request: the attention blocks of 32k tokens and one live state, nothing against the pool for Mamba.
    assert pooled.attention_blocks_per_request() == 2048
    summary = pooled.summary()
    assert "26 live" in summary and "0 checkpoint(s)" in summary
    assert "prefix-cache granularity (hash block size) 16 tokens" in summary and "of 16.00 GiB" in summary


def test_checkpoint_memory_buys_checkpoint_states_out_of_the_live_ones():
    specs = get_preset("nemotron-h-8b")
    plain = plan_kv_cache(specs, 16 * GiB, max_model_len=32768, options=PlanOptions(state_layout="state_pool"))
    slot = plain.state_pool.state_bytes
    checkpointed = plan_kv_cache(
        specs,
        16 * GiB,
        max_model_len=32768,
        options=PlanOptions(state_layout="state_pool", state_pool=StatePoolOptions(checkpoint_bytes=2 * GiB)),
    )
    pool = checkpointed.state_pool
    assert pool.state_bytes == slot
    assert pool.num_checkpoint_states == 2 * GiB // slot
    assert pool.num_live_states < plain.state_pool.num_live_states
    # 2 GiB holds about four requests' attention plus state: that many fewer live states.
    per_request = 2048 * plain.pages.block_bytes + slot
    assert plain.state_pool.num_live_states - pool.num_live_states == pytest.approx(2 * GiB / per_request, abs=1)
    check_state_pool_plan(checkpointed, specs, 16 * GiB)


def test_max_num_seqs_fixes_the_live_states_and_attention_takes_the_rest():
    specs = get_preset("jamba-1.5-mini")
    config = plan_kv_cache(
        specs,
        16 * GiB,
        max_model_len=32768,
        options=PlanOptions(state_layout="state_pool", state_pool=StatePoolOptions(max_num_seqs=8)),
    )
    pool = config.state_pool
    assert pool.num_live_states == 8 and pool.num_states == 9
    assert config.num_blocks == (16 * GiB - 9 * pool.state_bytes) // config.pages.block_bytes
    assert config.max_concurrency == 8  # states limit it; attention would hold more
    check_state_pool_plan(config, specs, 16 * GiB)
    with pytest.raises(InsufficientMemoryError, match="max_num_seqs=100000"):
        plan_kv_cache(
            specs,
            16 * GiB,
            max_model_len=32768,
            options=PlanOptions(state_layout="state_pool", state_pool=StatePoolOptions(max_num_seqs=100_000)),
        )


@pytest.mark.parametrize("max_num_seqs", [None, 8])
@pytest.mark.parametrize("checkpoint_bytes", [0, 300 << 20])
def test_a_state_pool_refusal_names_the_smallest_budget_that_fits(max_num_seqs, checkpoint_bytes):
    specs = get_preset("nemotron-h-8b")
    sizes = StatePoolOptions(max_num_seqs=max_num_seqs, checkpoint_bytes=checkpoint_bytes)
    options = PlanOptions(state_layout="state_pool", state_pool=sizes)
    with pytest.raises(InsufficientMemoryError, match="the smallest budget that fits is") as info:
        plan_kv_cache(specs, 512 << 20, max_model_len=32768, options=options)
    smallest = int(
        re.search(r"the smallest budget that fits is ([0-9,]+) B", str(info.value)).group(1).replace(",", "")
    )
    plan_kv_cache(specs, smallest, max_model_len=32768, options=options)
    with pytest.raises(InsufficientMemoryError):
        plan_kv_cache(specs, smallest - 1, max_model_len=32768, options=options)


def test_a_state_pool_too_small_for_one_request_names_the_budget():
    specs = get_preset("nemotron-h-8b")
    with pytest.raises(InsufficientMemoryError, match="memory_bytes=536870912 with checkpoint_bytes=0"):
        plan_kv_cache(specs, 512 << 20, max_model_len=32768, options=PlanOptions(state_layout="state_pool"))
    with pytest.raises(InsufficientMemoryError, match="checkpoint_bytes=1073741824"):
        plan_kv_cache(
            specs,
            GiB,
            max_model_len=32768,
            options=PlanOptions(state_layout="state_pool", state_pool=StatePoolOptions(checkpoint_bytes=GiB)),
        )


def test_a_mamba_only_model_on_a_state_pool_has_no_attention_pages():
    state = MambaSpec(shapes=((4, 8),), dtypes=("float32",))
    specs = {f"m{i}": state for i in range(3)}
    config = plan_kv_cache(specs, 10 * 3 * 128, max_model_len=4096, options=PlanOptions(state_layout="state_pool"))
    assert config.pages is None and config.num_blocks == 1 and config.attention_groups == ()
    assert config.state_pool.state_bytes == 3 * 128 and config.state_pool.num_states == 10
    assert config.max_concurrency == 9 and config.hash_block_size == 16
    assert "state row 384 B" in config.summary()


def test_each_mamba_type_is_one_group_and_each_request_holds_one_slot_per_group():
    mamba = MambaSpec(shapes=((4, 8),), dtypes=("float32",))
    delta = MambaSpec(shapes=((2, 8),), dtypes=("float32",), mamba_type="gated_delta_net")
    full = FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="float32")
    specs = {"m0": mamba, "a0": full, "d0": delta, "m1": mamba, "a1": full, "d1": delta, "d2": delta}
    config = plan_kv_cache(specs, 1 << 20, max_model_len=256, options=PlanOptions(state_layout="state_pool"))
    assert [g.layer_names for g in config.groups] == [("m0", "m1"), ("a0", "a1"), ("d0", "d1", "d2")]
    assert config.state_group_ids == (0, 2)
    assert config.state_pool.state_bytes == max(2 * 128, 3 * 64)
    assert config.state_pool.num_live_states == 2 * config.max_concurrency
    assert config.pages.layers == (("a0",), ("a1",))
    check_state_pool_plan(config, specs, 1 << 20)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"state_layout": "pages"}, "unknown state_layout 'pages'"),
        ({"state_layout": "shared_pages", "state_pool": StatePoolOptions(4)}, "max_num_seqs=4"),
        ({"state_layout": "attention_pages", "state_pool": StatePoolOptions(checkpoint_bytes=GiB)}, "1073741824"),
        ({"state_pool": {"max_num_seqs": 4}}, "state_pool must be a StatePoolOptions or None"),
        ({"state_layout": "state_pool", "num_blocks_override": 100}, "num_blocks_override=100"),
    ],
)
def test_bad_state_layout_arguments_raise_a_plan_error_naming_the_value(kwargs, named):
    with pytest.raises(PlanError, match=named):
        plan_kv_cache(get_preset("jamba-1.5-mini"), 16 * GiB, max_model_len=32768, options=PlanOptions(**kwargs))


def test_a_state_pool_without_recurrent_layers_is_refused():
    with pytest.raises(PlanError, match=r"needs recurrent .* every layer is attention: full_attention"):
        plan_kv_cache(
            get_preset("llama-3.1-8b"), 16 * GiB, max_model_len=32768, options=PlanOptions(state_layout="state_pool")
        )


def test_hand_built_state_pools_check_their_live_states():
    with pytest.raises(PlanError, match="num_live_states=4 exceeds the 3 usable states of num_states=4"):
        StatePool(num_states=4, state_bytes=64, num_live_states=4)
    with pytest.raises(PlanError, match="state_bytes must be a positive int, got 0"):
        StatePool(num_states=4, state_bytes=0)
    assert StatePool(num_states=4).num_checkpoint_states is None
    assert StatePool(num_states=4, state_bytes=64, num_live_states=2).num_checkpoint_states == 1


@settings(max_examples=100, deadline=None)
@given(
    specs=models().filter(lambda specs: any(isinstance(s, MambaSpec) for s in specs.values())),
    memory=st.integers(1, 1 << 26),
    max_model_len=st.integers(1, 4096),
    max_num_seqs=st.none() | st.integers(1, 64),
    checkpoint_bytes=st.integers(0, 1 << 22),
)
def test_any_state_pool_plan_fits_its_budget_and_one_request(
    specs, memory, max_model_len, max_num_seqs, checkpoint_bytes
):
    try:
        config = plan_kv_cache(
            specs,
            memory,
            max_model_len=max_model_len,
            options=PlanOptions(
                state_layout="state_pool",
                state_pool=StatePoolOptions(max_num_seqs=max_num_seqs, checkpoint_bytes=checkpoint_bytes),
            ),
        )
    except IncompatibleSpecsError:
        return
    except InsufficientMemoryError as err:
        assert f"memory_bytes={memory}" in str(err)
        return
    check_state_pool_plan(config, specs, memory)
    if max_num_seqs is None:
        assert config.state_pool.num_checkpoint_states == checkpoint_bytes // config.state_pool.state_bytes


def test_a_type_s_layers_are_dealt_round_robin_into_groups_as_vllm_does():
    full = FullAttentionSpec(num_kv_heads=1, head_size=8)
    swa = SlidingWindowSpec(num_kv_heads=1, head_size=8, sliding_window=64)
    specs = {"l1": full, "l2": full, "l3": swa, "l4": swa, "l5": swa, "l6": swa}
    config = plan_kv_cache(specs, 1 << 20, max_model_len=256)
    assert [g.layer_names for g in config.groups] == [("l1", "l2"), ("l3", "l5"), ("l4", "l6")]


@pytest.mark.parametrize("name", ["nemotron-h-8b", "qwen3-next-80b", "jamba-1.5-mini"])
def test_recurrent_hybrids_default_to_one_memory_that_reaches_the_exact_concurrency_bound(name):
    specs = get_preset(name)
    config = plan_kv_cache(specs, 16 * GiB, max_model_len=32768)
    assert config.shared_states is not None and config.state_pool is None
    assert config.hash_block_size == 16
    assert config.max_concurrency == exact_concurrency_bound(specs, 16 * GiB, 32768)
    assert config.num_blocks * config.pages.block_bytes <= 16 * GiB
    assert "one memory: a state" in config.summary()


def test_the_state_pool_sizes_are_checked_when_built():
    with pytest.raises(PlanError, match="max_num_seqs"):
        StatePoolOptions(max_num_seqs=0)
    with pytest.raises(PlanError, match="checkpoint_bytes"):
        StatePoolOptions(checkpoint_bytes=-1)
