"""Save a tiny random-weight Hugging Face checkpoint of one family (Llama, Qwen3, Gemma-3 text,
Qwen3-Next, Nemotron-H).

The checkpoints jaxkv's tests compare with transformers, and a directory to try
``scripts/serve.py --checkpoint DIR`` and ``scripts/bench_serve.py --checkpoint DIR`` on:

    python scripts/save_tiny_checkpoint.py --family llama --out /tmp/tiny-llama
    python scripts/save_tiny_checkpoint.py --family gemma3 --out /tmp/tiny-gemma3 --max_shard_size 100KB

Draws the weights with transformers and torch (the ``oracle`` extra) where they are
installed. Without them, a checkout's stored seed-0 checkpoint of the family
(``tests/oracle/``, saved by transformers with this file's configs, checked against it
by ``pytest -m oracle``) is copied instead, so trying the server needs no torch;
another ``--seed`` or ``--max_shard_size`` is then refused in one line.

Every tensor is redrawn after construction, norms included, because transformers'
default init leaves norms constant (a norm read with the wrong offset would go unseen),
Nemotron-H's routing biases included. A byte-level ``tokenizer.json`` (256 byte tokens
and :data:`SPECIAL_TOKENS`, the ``tokenizers`` library) and a ``tokenizer_config.json``
with a chat template are saved beside the weights, so prompts may be text or chats,
offline; generation stops at ``<|endoftext|>``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", *(f"<|reserved_{i}|>" for i in range(4)))
"""Tokens after the 256 bytes: the end of a text or turn (EOS), the chat roles, and spares
so the vocabulary (264) splits over up to 8 devices."""
EOS_TOKEN_ID = 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat as role-tagged turns, each ended by EOS; the reply starts after ``<|assistant|>``."""

TINY_SIZES: dict[str, Any] = {
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "eos_token_id": EOS_TOKEN_ID,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
"""Sizes the tiny checkpoints share (2 KV heads, so a 2-device mesh splits them)."""

WINDOW = 8
"""The sliding window of the tiny Gemma-3 (prompts of the tests are longer)."""


def tiny_config(family: str) -> Any:
    """A tiny transformers config of ``family`` (one of :data:`FAMILIES`), float32."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            **TINY_SIZES,
            num_hidden_layers=3,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            **TINY_SIZES,
            num_hidden_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **TINY_SIZES,
            num_hidden_layers=6,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            },
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    if family == "qwen3_next":
        # Gated DeltaNet : full attention = 3 : 1, value heads grouped 2 per key head, a
        # dense MLP on layer 1 and a sparse MoE (8 experts, top 2, a shared expert) elsewhere.
        return transformers.Qwen3NextConfig(
            **TINY_SIZES,
            num_hidden_layers=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if family == "nemotron_h":
        # Mamba-2, MLP, attention, Mamba-2, MoE (8 experts in 2 groups, top 2, a latent projection).
        return transformers.NemotronHConfig(
            **TINY_SIZES,
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "moe"],
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=32,
        )
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_next", "nemotron_h")

ORACLE_DIR = Path(__file__).resolve().parent.parent / "tests" / "oracle"
"""Where a checkout stores each family's seed-0 checkpoint and transformers' outputs on it
(``scripts/save_oracle_references.py`` writes them)."""
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors")
"""The files of a stored checkpoint."""


def _unit_centred(family: str, name: str) -> bool:
    """Whether a norm weight scales by itself (drawn around 1) rather than by ``1 + weight``
    (Gemma-3's and Qwen3-Next's zero-centred norms, drawn around 0; Qwen3-Next's gated
    DeltaNet norm is a plain one)."""
    if family == "gemma3":
        return False
    return family != "qwen3_next" or "linear_attn.norm" in name


def tiny_model(family: str, *, seed: int = 0) -> Any:
    """A transformers causal LM of ``family`` with every tensor drawn at random (float32, eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family)
    config._attn_implementation = "eager"
    cls = transformers.Gemma3ForCausalLM if family == "gemma3" else transformers.AutoModelForCausalLM
    model = cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)
    with torch.no_grad():
        routing_biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, tensor in [*model.named_parameters(), *routing_biases]:
            scale = 0.3 if "norm" in name else 0.1
            tensor.copy_(
                torch.randn_like(tensor) * scale + (1.0 if "norm" in name and _unit_centred(family, name) else 0.0)
            )
    return model.float().eval()


def save_tiny_checkpoint(
    family: str, directory: str | Path, *, seed: int = 0, max_shard_size: str | None = None
) -> Any:
    """Save a :func:`tiny_model` of ``family`` to ``directory``; returns the transformers model."""
    model = tiny_model(family, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **kwargs)
    return model


def copy_stored_checkpoint(family: str, directory: str | Path) -> None:
    """Copy the checkout's stored seed-0 ``family`` checkpoint (:data:`ORACLE_DIR`) into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(ORACLE_DIR / family / name, Path(directory) / name)


def save_tiny_tokenizer(directory: str | Path) -> None:
    """A byte-level BPE ``tokenizer.json`` of one token per byte (no merges) and
    :data:`SPECIAL_TOKENS` after them, and a ``tokenizer_config.json`` with
    :data:`CHAT_TEMPLATE`: text of any language encodes, and chats render, offline."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": SPECIAL_TOKENS[0], "chat_template": CHAT_TEMPLATE, "model_max_length": 512}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


PROG = "save_tiny_checkpoint.py"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined only when it runs (the tests import its functions)."""
    flags.DEFINE_enum("family", None, list(FAMILIES), "the architecture family")
    flags.DEFINE_string("out", None, "directory to write (created)")
    flags.DEFINE_integer("seed", 0, "seed of the random weights", lower_bound=0)
    flags.DEFINE_string("max_shard_size", None, "e.g. 100KB: several *.safetensors and an index")


def main(argv: list[str]) -> None:
    for name in ("family", "out"):
        if FLAGS[name].value is None:
            exit_error(PROG, f"--{name} is required")
    try:
        import tokenizers  # noqa: F401
    except ImportError as err:
        exit_error(PROG, f"needs tokenizers (pip install '.[tokenizers]'): {err}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        stored = ORACLE_DIR / FLAGS.family
        if FLAGS.seed != 0:
            what = f"--seed {FLAGS.seed} (the stored checkpoint is seed 0)"
        elif FLAGS.max_shard_size is not None:
            what = f"--max_shard_size {FLAGS.max_shard_size}"
        elif not stored.is_dir():
            what = f"a checkpoint outside a checkout (no {stored})"
        else:
            what = ""
        if what:
            exit_error(PROG, f"{what} needs transformers and torch (pip install '.[oracle]'): {err}")
        copy_stored_checkpoint(FLAGS.family, FLAGS.out)
        source = f"copied from {stored} (seed 0; transformers and torch are not installed)"
    else:
        save_tiny_checkpoint(FLAGS.family, FLAGS.out, seed=FLAGS.seed, max_shard_size=FLAGS.max_shard_size)
        source = f"seed {FLAGS.seed}, drawn with transformers"
    save_tiny_tokenizer(FLAGS.out)
    print(f"saved a tiny random {FLAGS.family} checkpoint to {FLAGS.out}: {source}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=flags_parser(PROG))
