"""Loading Hugging Face-format checkpoint directories: one file or shards, dtypes, a mesh, refusals."""

from __future__ import annotations

import contextlib
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_checkpoints import save_tiny_checkpoint, save_tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file
from script_runs import REPO, run_python_without, run_script

from jaxkv.device.mesh import MODEL_AXIS, model_mesh
from jaxkv.errors import JaxkvError
from jaxkv.models.checkpoint import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnknownArchitectureError,
    eos_token_ids,
    load_pretrained,
)
from jaxkv.models.text import load_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_tiny_checkpoint("llama", directory)
    return directory


def _weights(model):
    return {name: np.asarray(value) for name, value in model.params.items()}


def save_sharded(source, directory, num_shards=3):
    """``source``'s weights split over ``num_shards`` files with an index, as transformers
    writes a checkpoint above its shard size."""
    weights = load_file(source / "model.safetensors")
    directory.mkdir(exist_ok=True)
    shutil.copyfile(source / "config.json", directory / "config.json")
    weight_map = {}
    for shard, names in enumerate(np.array_split(sorted(weights), num_shards)):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({name: weights[name] for name in names}, directory / file)
        weight_map.update(dict.fromkeys(names, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_with_index_loads_the_same_weights(llama_dir, tmp_path):
    save_sharded(llama_dir, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    one, shards = _weights(load_pretrained(llama_dir)), _weights(load_pretrained(tmp_path))
    assert one.keys() == shards.keys()
    assert all(np.array_equal(one[name], shards[name]) for name in one)


def test_dtype_none_keeps_the_checkpoints_and_a_dtype_casts(llama_dir):
    assert {v.dtype for v in load_pretrained(llama_dir).params.values()} == {np.dtype("float32")}
    model = load_pretrained(llama_dir, dtype="bfloat16")
    assert {v.dtype.name for v in model.params.values()} == {"bfloat16"}
    assert {spec.dtype for spec in model.layer_specs().values()} == {"bfloat16"}


def test_a_mesh_receives_each_weight_split_by_its_partition_spec(llama_dir):
    mesh = model_mesh(2)
    model = load_pretrained(llama_dir, mesh=mesh)
    whole = _weights(load_pretrained(llama_dir))
    q = model.params["model.layers.0.self_attn.q_proj.weight"]
    assert q.sharding.spec == PartitionSpec(MODEL_AXIS, None)
    assert [s.data.shape for s in q.addressable_shards] == [(32, 64), (32, 64)]
    o = model.params["model.layers.0.self_attn.o_proj.weight"]
    assert [s.data.shape for s in o.addressable_shards] == [(64, 32), (64, 32)]
    assert model.params["model.norm.weight"].sharding.spec == PartitionSpec()
    assert all(np.array_equal(np.asarray(model.params[name]), whole[name]) for name in whole)


def test_a_split_that_does_not_divide_is_refused_naming_the_weight(llama_dir):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), (MODEL_AXIS,))
    with pytest.raises(ShapeMismatchError, match=r"q_proj.weight"):
        load_pretrained(llama_dir, mesh=mesh)


def _copy(source, target, *, config=None, drop=None):
    """``source``'s checkpoint in ``target``, its config edited and one tensor dropped."""
    from safetensors.numpy import save_file

    target.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    model = load_pretrained(source)
    save_file({k: v for k, v in _weights(model).items() if k != drop}, str(target / "model.safetensors"))


def test_a_missing_tensor_is_named(llama_dir, tmp_path):
    _copy(llama_dir, tmp_path / "ckpt", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(MissingTensorError, match=r"model.layers.1.mlp.up_proj.weight"):
        load_pretrained(tmp_path / "ckpt")


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(llama_dir, tmp_path):
    _copy(llama_dir, tmp_path / "ckpt", config={"intermediate_size": 96})
    with pytest.raises(ShapeMismatchError, match=r"mlp.gate_proj.weight' has shape \(128, 64\).*\(96, 64\)"):
        load_pretrained(tmp_path / "ckpt")


def test_an_unknown_architecture_is_named(llama_dir, tmp_path):
    _copy(llama_dir, tmp_path / "ckpt", config={"architectures": ["MixtralForCausalLM"]})
    with pytest.raises(UnknownArchitectureError, match="MixtralForCausalLM"):
        load_pretrained(tmp_path / "ckpt")


def test_a_missing_directory_is_refused_without_downloading(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "meta-llama/Llama-3.2-1B")


@pytest.mark.subprocess
def test_serve_script_serves_a_saved_checkpoint_from_text_prompts(tmp_path):
    save_tiny_checkpoint("qwen3", tmp_path)
    save_tiny_tokenizer(tmp_path)
    served = run_script(
        "serve.py",
        "--checkpoint",
        str(tmp_path),
        "--prompt",
        "Hello there",
        "--prompt",
        "Hello again",
        "--max_new_tokens",
        "4",
        "--max_model_len",
        "64",
        "--memory",
        "1MiB",
    )
    assert served.returncode == 0, served.stderr
    assert "Qwen3ForCausalLM" in served.stdout and served.stdout.count("decoded: ") == 2
    assert "tokens identical to the dense (unpaged) forward: yes" in served.stdout


def _served_tokens(stdout: str) -> list[list[int]]:
    """Each request's output tokens, from serve.py's ``... -> [t, ...]`` lines."""
    return [json.loads(line.split("-> ")[1]) for line in stdout.splitlines() if "  ttft " in line]


@pytest.mark.subprocess
def test_serve_script_stops_a_sequence_at_the_checkpoints_eos_and_checks_the_cut_reference(tmp_path):
    save_tiny_checkpoint("qwen3", tmp_path)
    flags = ("--checkpoint", str(tmp_path), "--num_requests", "3", "--max_new_tokens", "6", "--max_model_len", "256")
    before = run_script("serve.py", *flags)
    assert before.returncode == 0, before.stderr
    tokens = _served_tokens(before.stdout)
    eos = tokens[0][2]  # the third token of the first request becomes the checkpoint's EOS
    generation_config = tmp_path / "generation_config.json"
    generation_config.write_text(json.dumps({**json.loads(generation_config.read_text()), "eos_token_id": eos}))
    after = run_script("serve.py", *flags)
    assert after.returncode == 0, after.stderr
    assert f"a sequence stops at the checkpoint's EOS ids [{eos}]" in after.stdout
    assert _served_tokens(after.stdout) == [t[: t.index(eos) + 1] if eos in t else t for t in tokens]
    assert "tokens identical to the dense (unpaged) forward: yes" in after.stdout


@pytest.mark.subprocess
def test_bench_serve_script_benchmarks_a_saved_checkpoint_with_caching_on_and_off(llama_dir, tmp_path):
    bench = run_script(
        "bench_serve.py",
        *("--checkpoint", str(llama_dir), "--prompt_len", "64", "--max_model_len", "128", "--memory", "4MiB"),
        *("--num_requests", "2", "--repeats", "1", "--max_new_tokens", "4", "--max_num_batched_tokens", "128"),
        *("--out", str(tmp_path / "bench.json")),
    )
    assert bench.returncode == 0, bench.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["results"]) == {"no prefix caching", "prefix caching"} and report["token_check"]["passed"]


@pytest.mark.subprocess
def test_serve_script_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    served = run_script("serve.py", "--checkpoint", str(tmp_path / "absent"))
    assert served.returncode == 2
    assert served.stderr.strip().splitlines() == [
        f"serve.py: error: checkpoint directory '{tmp_path / 'absent'}' does not exist (a local path only)"
    ]


def _save_tiny_checkpoint_without_torch(*args: str):
    """``scripts/save_tiny_checkpoint.py args`` run where torch and transformers cannot be imported."""
    script = "scripts/save_tiny_checkpoint.py"
    code = f"import runpy, sys; sys.argv = {[script, *args]!r}; runpy.run_path({script!r}, run_name='__main__')"
    return run_python_without(("torch", "transformers"), code)


@pytest.mark.subprocess
def test_without_torch_the_tiny_checkpoint_script_copies_the_stored_one_and_refuses_other_seeds(tmp_path):
    saved = _save_tiny_checkpoint_without_torch("--family", "llama", "--out", str(tmp_path / "llama"))
    assert saved.returncode == 0, saved.stderr
    assert "copied from" in saved.stdout
    stored = REPO / "tests" / "oracle" / "llama"
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "llama" / name).read_bytes() == (stored / name).read_bytes()
    text = load_tokenizer(tmp_path / "llama")
    assert text is not None and text.chat_template and text.special["eos_token"] == "<|endoftext|>"
    refused = _save_tiny_checkpoint_without_torch("--family", "llama", "--out", str(tmp_path / "x"), "--seed", "3")
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("save_tiny_checkpoint.py: error: --seed 3 (the stored checkpoint is seed 0) needs")
    assert not (tmp_path / "x").exists()


def test_a_config_without_a_needed_field_is_named(llama_dir, tmp_path):
    _copy(llama_dir, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_pretrained(tmp_path / "ckpt")


def test_a_bfloat16_checkpoint_loads_as_bfloat16_and_runs(tmp_path):
    source = tmp_path / "float32"
    save_tiny_checkpoint("gemma3", source)
    weights = load_file(source / "model.safetensors")
    save_file({name: w.astype(ml_dtypes.bfloat16) for name, w in weights.items()}, tmp_path / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    model = load_pretrained(tmp_path)
    assert {v.dtype.name for v in model.params.values()} == {"bfloat16"}
    logits = model.dense(model.params, np.arange(12)[None])
    assert logits.dtype == np.float32 and np.isfinite(np.asarray(logits)).all()


_ODD_VALUES = st.one_of(
    st.just("<delete>"),
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.sampled_from(["mamba", "attention", "full_attention", "M", "*"]), max_size=6),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "full_attention"]), st.integers(0, 2), max_size=2),
)


@pytest.fixture(scope="module")
def saved_families(tmp_path_factory):
    directories = {}
    for family in ("qwen3_next", "nemotron_h", "gemma3"):
        directories[family] = tmp_path_factory.mktemp(family)
        save_tiny_checkpoint(family, directories[family])
    return directories


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "gemma3"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_config_of_each_family_loads_or_is_refused_with_a_typed_error(saved_families, family, data):
    """Missing keys, zero heads, wrong types, odd layer lists: a typed error (or a model),
    never a StopIteration, KeyError, ZeroDivisionError or RecursionError."""
    source = saved_families[family]
    config = json.loads((source / "config.json").read_text())
    for field in data.draw(st.lists(st.sampled_from(sorted(config)), min_size=1, max_size=3)):
        value = data.draw(_ODD_VALUES)
        if value == "<delete>":
            config.pop(field, None)
        else:
            config[field] = value
    target = source.parent / f"{source.name}-mutated"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(config))
    if not (target / "model.safetensors").exists():
        shutil.copy(source / "model.safetensors", target)
    with contextlib.suppress(JaxkvError):  # any other exception fails the test
        load_pretrained(target, max_model_len=64)


def test_eos_ids_come_from_the_generation_config_then_the_config_and_a_list_stays_a_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 10}))
    assert eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(tmp_path) == (7, 9)
    for bad in ("7", 10, 2**40):  # an id the model cannot draw would overflow the step's int32 rows (issue 41)
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(CheckpointError, match=f"ids below the vocabulary's 10, got {bad!r}"):
            eos_token_ids(tmp_path)
    assert eos_token_ids(tmp_path / "elsewhere") == ()
