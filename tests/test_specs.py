"""Layer specs: bytes per page/state, type keys, merging, validation, blocks per request."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxkv.specs import (
    MAMBA_BLOCKS_PER_REQUEST,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    SpecError,
    SpecMergeError,
    canonical_dtype,
)

LLAMA = FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="bfloat16")


def sliding(window: int, **kw) -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=kw.pop("num_kv_heads", 8), head_size=128, sliding_window=window, **kw)


# ------------------------------------------------------------------ bytes


def test_llama_3_1_8b_page_is_64_kib_at_block_16():
    # 8 KV heads x 128 x (K and V) x 2 B = 4096 B per token per layer.
    assert LLAMA.bytes_per_token == 4096
    assert LLAMA.page_size_bytes(16) == 65536
    assert LLAMA.page_size_bytes(1) == 4096


def test_dtype_sets_the_itemsize_including_ml_dtypes():
    fp8 = FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="float8_e4m3fn")
    fp32 = FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="float32")
    assert fp8.page_size_bytes(16) == 32768
    assert fp32.page_size_bytes(16) == 131072


def test_dtype_objects_and_aliases_are_stored_by_canonical_name():
    assert FullAttentionSpec(num_kv_heads=1, head_size=8, dtype=np.float32).dtype == "float32"
    assert FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="f4").dtype == "float32"
    assert FullAttentionSpec(num_kv_heads=1, head_size=8, dtype=ml_dtypes.bfloat16) == FullAttentionSpec(
        num_kv_heads=1, head_size=8
    )
    assert canonical_dtype("float8_e5m2") == "float8_e5m2"


def test_deepseek_mla_caches_one_latent_of_576_values_per_token():
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")
    assert (mla.num_kv_heads, mla.head_size) == (1, 576)
    assert mla.bytes_per_token == 1152  # no separate V
    assert mla.page_size_bytes(16) == 18432


def test_mla_replace_rederives_head_size():
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)
    smaller = dataclasses.replace(mla, kv_lora_rank=256)
    assert smaller.head_size == 320
    with pytest.raises(TypeError):
        MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, num_kv_heads=2)  # derived, not set


def test_mamba_state_is_the_sum_of_its_tensors_and_ignores_block_size():
    # Jamba-1.5-Mini Mamba-1 layer: conv (8192, 3) bf16 + ssm (8192, 16) fp32.
    spec = MambaSpec(shapes=((8192, 3), (8192, 16)), dtypes=("bfloat16", "float32"))
    assert spec.state_bytes == 8192 * 3 * 2 + 8192 * 16 * 4 == 573440
    assert spec.page_size_bytes(16) == spec.page_size_bytes(4096) == 573440


def test_mamba_lists_are_normalised_so_the_spec_stays_hashable():
    spec = MambaSpec(shapes=[[4, 3], [4, 8]], dtypes=["float32", np.float32])
    assert spec.shapes == ((4, 3), (4, 8))
    assert spec.dtypes == ("float32", "float32")
    assert hash(spec) == hash(MambaSpec(shapes=((4, 3), (4, 8)), dtypes=("float32", "float32")))


def test_specs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA.num_kv_heads = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        FullAttentionSpec(8, 128)  # type: ignore[misc]


def test_abstract_specs_cannot_be_built():
    with pytest.raises(TypeError):
        KVCacheSpec()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        AttentionSpec(num_kv_heads=1, head_size=1)  # type: ignore[abstract]


# -------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "build, named",
    [
        (lambda: FullAttentionSpec(num_kv_heads=0, head_size=128), "num_kv_heads"),
        (lambda: FullAttentionSpec(num_kv_heads=8, head_size=-1), "-1"),
        (lambda: FullAttentionSpec(num_kv_heads=True, head_size=8), "True"),
        (lambda: FullAttentionSpec(num_kv_heads=8, head_size=1.5), "1.5"),
        (lambda: FullAttentionSpec(num_kv_heads=8, head_size=8, dtype="floaty"), "floaty"),
        (lambda: FullAttentionSpec(num_kv_heads=8, head_size=8, dtype="bool"), "bool"),
        (lambda: FullAttentionSpec(num_kv_heads=8, head_size=8, dtype="float4_e2m1fn"), "sub-byte"),
        (lambda: sliding(0), "sliding_window"),
        (lambda: ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=8, attention_chunk_size=-8), "-8"),
        (lambda: MLASpec(kv_lora_rank=0, qk_rope_head_dim=64), "kv_lora_rank"),
        (lambda: MambaSpec(shapes=((4, 3),), dtypes=("float32", "float32")), "2 dtypes"),
        (lambda: MambaSpec(shapes=(), dtypes=()), "empty"),
        (lambda: MambaSpec(shapes=((4, 0),), dtypes=("float32",)), "(4, 0)"),
        (lambda: MambaSpec(shapes=((),), dtypes=("float32",)), "()"),
        (lambda: MambaSpec(shapes=((4,),), dtypes=("nope",)), "nope"),
        (lambda: MambaSpec(shapes=((4,),), dtypes=("float32",), mamba_type=""), "mamba_type"),
    ],
)
def test_bad_values_raise_a_spec_error_naming_them(build, named):
    with pytest.raises(SpecError, match=named.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)
    assert issubclass(SpecMergeError, SpecError)


# ------------------------------------------------------------ type keys, merge


def test_type_key_separates_window_dtype_head_shape_and_class():
    keys = {
        sliding(1024).type_key,
        sliding(512).type_key,
        sliding(1024, dtype="float32").type_key,
        sliding(1024, num_kv_heads=4).type_key,
        FullAttentionSpec(num_kv_heads=8, head_size=128).type_key,
        ChunkedLocalAttentionSpec(num_kv_heads=8, head_size=128, attention_chunk_size=1024).type_key,
    }
    assert len(keys) == 6
    assert sliding(1024).type_key == sliding(1024).type_key


def test_mamba_recurrences_with_equal_shapes_keep_separate_type_keys():
    a = MambaSpec(shapes=((4, 3),), dtypes=("float32",), mamba_type="mamba2")
    b = MambaSpec(shapes=((4, 3),), dtypes=("float32",), mamba_type="gated_delta_net")
    assert a.type_key != b.type_key


def test_equal_specs_merge_into_the_same_spec():
    assert SlidingWindowSpec.merge([sliding(1024)] * 5) == sliding(1024)
    assert KVCacheSpec.merge([LLAMA, LLAMA]) is LLAMA


def test_different_windows_do_not_merge():
    with pytest.raises(SpecMergeError, match="sliding_window=512"):
        SlidingWindowSpec.merge([sliding(1024), sliding(512)])


def test_merge_rejects_other_classes_and_empty_input():
    with pytest.raises(SpecMergeError, match="FullAttentionSpec"):
        SlidingWindowSpec.merge([sliding(1024), LLAMA])
    with pytest.raises(SpecMergeError, match="none"):
        FullAttentionSpec.merge([])


# ---------------------------------------------------------- blocks per request


def test_full_attention_needs_every_block_of_the_request():
    assert LLAMA.blocks_per_request(32768, 16) == 2048
    assert LLAMA.blocks_per_request(17, 16) == 2
    assert LLAMA.max_memory_bytes(32768, 16) == 2048 * 65536


def test_sliding_window_needs_its_window_plus_one_step():
    # Gemma 3: W=1024, B=8192: 9215 tokens resident, 1 + cdiv(9214, 16) = 577 blocks.
    assert sliding(1024).blocks_per_request(32768, 16, 8192) == 577
    # A short request never needs more than its own length.
    assert sliding(1024).blocks_per_request(100, 16, 8192) == 7


def test_chunked_local_needs_one_chunk_plus_one_step():
    spec = ChunkedLocalAttentionSpec(num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    assert spec.blocks_per_request(32768, 16, 8192) == 1024  # cdiv(16383, 16), aligned
    unaligned = ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=8, attention_chunk_size=100)
    # 99 + 16 = 115 tokens that may start anywhere in a block: 1 + cdiv(114, 16).
    assert unaligned.blocks_per_request(10**6, 16, 16) == 9


def test_mamba_needs_a_fixed_number_of_blocks_whatever_the_length():
    spec = MambaSpec(shapes=((4, 3),), dtypes=("float32",))
    assert spec.blocks_per_request(10, 16) == spec.blocks_per_request(10**6, 16)
    assert spec.blocks_per_request(10, 16) == MAMBA_BLOCKS_PER_REQUEST


def test_blocks_per_request_rejects_non_positive_arguments():
    with pytest.raises(SpecError, match="max_model_len"):
        LLAMA.blocks_per_request(0, 16)
    with pytest.raises(SpecError, match="block_size"):
        sliding(8).blocks_per_request(10, -16)
    with pytest.raises(SpecError, match="block_size"):
        LLAMA.page_size_bytes(0)


def _peak_blocks(first_needed, block_size: int, max_len: int, step: int) -> int:
    """Most blocks held over every (computed, new) step of a request, by brute force."""
    peak = 0
    for computed in range(max_len):
        for new in range(1, min(step, max_len - computed) + 1):
            first = first_needed(computed) // block_size
            peak = max(peak, (computed + new - 1) // block_size - first + 1)
    return peak


@given(
    window=st.integers(1, 40),
    step=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    max_len=st.integers(1, 90),
)
def test_sliding_window_formula_bounds_every_step_and_is_tight(window, step, block_size, max_len):
    spec = SlidingWindowSpec(num_kv_heads=1, head_size=8, sliding_window=window)
    formula = spec.blocks_per_request(max_len, block_size, step)
    # The manager keeps tokens from computed - window + 1 on.
    peak = _peak_blocks(lambda c: max(0, c - window + 1), block_size, max_len, step)
    assert peak <= formula
    if max_len >= window + step + 2 * block_size:
        assert peak == formula


@given(
    chunk=st.integers(1, 40),
    step=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    max_len=st.integers(1, 90),
)
def test_chunked_local_formula_bounds_every_step(chunk, step, block_size, max_len):
    spec = ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=8, attention_chunk_size=chunk)
    formula = spec.blocks_per_request(max_len, block_size, step)
    # The manager keeps tokens from the start of the current chunk on.
    peak = _peak_blocks(lambda c: c // chunk * chunk, block_size, max_len, step)
    assert peak <= formula
