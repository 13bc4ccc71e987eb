"""Engine-thread CPU time per step with text made inline against text made off the engine's thread.

Two engines of one checkpoint (``--checkpoint``: a Hugging Face-format directory with a
``tokenizer.json``, e.g. ``scripts/save_tiny_checkpoint.py --family llama --out DIR``) run the
same requests side by side: ``inline`` makes the text in :meth:`~jaxkv.serving.engine.Engine.step`
(detokenization, stop strings), ``off`` leaves it to the caller
(:meth:`~jaxkv.serving.engine.Engine.set_inline_text`), as
:class:`~jaxkv.serving.async_engine.AsyncEngine` does, and its deltas go through a
:class:`~jaxkv.serving.text_stage.TextStage` (what the event loop runs), timed apart. Each
engine holds ``--seqs`` sequences decoding (seeded sampling, so both draw the same tokens; a
``--stop_share`` of them with a stop string that never matches, so their text is held back
and searched). Figures are thread CPU time per step (``time.thread_time``), medians over
``--windows`` windows of ``--steps`` steps, the two engines alternating window by window; at
the end both engines' texts are compared (they must be identical).

    python3 scripts/save_tiny_checkpoint.py --family llama --out /tmp/tiny-llama
    PYTHONPATH=. python3 scripts/bench_detok.py --checkpoint /tmp/tiny-llama --out bench_detok.json
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser, write_json

PROG = "bench_detok.py"

flags.DEFINE_string("checkpoint", None, "a checkpoint directory with a tokenizer.json")
flags.DEFINE_list("seqs", ["32", "128"], "running sequences, one row each")
flags.DEFINE_integer("steps", 20, "steps per window", lower_bound=1)
flags.DEFINE_integer("windows", 5, "windows per engine, alternating", lower_bound=1)
flags.DEFINE_float("stop_share", 0.5, "share of the requests with a stop string", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_string("out", None, "write the figures as JSON here")
FLAGS = flags.FLAGS

PROMPT = "The cache holds blocks of keys and values; "
NEVER = "\x00\x00never\x00"


def _engines(checkpoint: Path, num_seqs: int, max_tokens: int):
    """The inline and the token-only engine, each with ``num_seqs`` requests added."""
    from jaxkv.serving.engine import Engine
    from jaxkv.serving.sampling_params import SamplingParams

    def build() -> Engine:
        return Engine.from_pretrained(
            checkpoint, memory_bytes=96 << 20, max_model_len=512, max_num_seqs=num_seqs, max_num_batched_tokens=1024
        )

    inline, off = build(), build()
    if inline.tokenizer is None:
        exit_error(PROG, f"--checkpoint={checkpoint} has no tokenizer.json (or the tokenizers library is missing)")
    off.set_inline_text(False)
    prompt = inline.tokenizer.encode(PROMPT)
    stops = round(FLAGS.stop_share * num_seqs)
    params = [
        SamplingParams(seed=i, max_tokens=max_tokens, ignore_eos=True, stop=(NEVER,) if i < stops else ())
        for i in range(num_seqs)
    ]
    return inline, off, prompt, params


def _row(checkpoint: Path, num_seqs: int) -> dict:
    """One size's figures."""
    from jaxkv.serving.text_stage import TextStage

    inline, off, prompt, params = _engines(checkpoint, num_seqs, FLAGS.windows * FLAGS.steps + 64)
    assert off.tokenizer is not None
    stage = TextStage(off.tokenizer, off.eos_token_ids)
    texts: dict[str, dict[str, str]] = {"inline": {}, "off": {}}
    for p in params:
        rid = inline.add_request(prompt, p)
        off.add_request(prompt, p, request_id=rid)
        stage.add(rid, p)
        texts["inline"][rid] = texts["off"][rid] = ""
    text_off = texts["off"]

    def step_inline() -> float:
        start = time.thread_time()
        step = inline.step()
        spent = time.thread_time() - start
        for d in step.deltas:
            texts["inline"][d.request_id] += d.text
        return spent

    def step_off() -> tuple[float, float]:
        start = time.thread_time()
        step = off.step()
        spent = time.thread_time() - start
        start = time.thread_time()
        for d in step.deltas:
            delta = stage.process(d).delta
            if delta is not None:
                text_off[d.request_id] += delta.text
        return spent, time.thread_time() - start

    while inline.num_running < num_seqs or off.num_running < num_seqs:  # every request admitted
        step_inline()
        step_off()
    for _ in range(8):  # prefills done, decode steps compiled
        step_inline()
        step_off()
    windows: dict[str, list[float]] = {"inline": [], "off": [], "text": []}
    for _ in range(FLAGS.windows):
        windows["inline"].append(statistics.fmean(step_inline() for _ in range(FLAGS.steps)))
        pairs = [step_off() for _ in range(FLAGS.steps)]
        windows["off"].append(statistics.fmean(engine for engine, _ in pairs))
        windows["text"].append(statistics.fmean(text for _, text in pairs))
    for rid in list(texts["inline"]):  # both end here: the held-back text comes with the abort
        inline.abort(rid)
        off.abort(rid)
    for d in inline.step().deltas:
        texts["inline"][d.request_id] += d.text
    for d in off.step().deltas:
        delta = stage.process(d).delta
        if delta is not None:
            text_off[d.request_id] += delta.text
    assert not inline.has_unfinished and not off.has_unfinished
    ms = {side: 1e3 * statistics.median(values) for side, values in windows.items()}
    return {
        "seqs": num_seqs,
        "inline_engine_ms": ms["inline"],
        "off_engine_ms": ms["off"],
        "off_text_ms": ms["text"],
        "engine_saving_ms": ms["inline"] - ms["off"],
        "texts_identical": texts["inline"] == texts["off"],
        "windows_ms": {side: [1e3 * v for v in values] for side, values in windows.items()},
    }


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.checkpoint is None or not (Path(FLAGS.checkpoint) / "tokenizer.json").exists():
        exit_error(PROG, f"--checkpoint={FLAGS.checkpoint} must be a checkpoint directory with a tokenizer.json")
    try:
        sizes = [int(n) for n in FLAGS.seqs]
    except ValueError:
        exit_error(PROG, f"--seqs must be ints, got {','.join(FLAGS.seqs)}")
    rows = [_row(Path(FLAGS.checkpoint), n) for n in sizes]
    print(f"thread CPU ms per step, medians of {FLAGS.windows} windows x {FLAGS.steps} steps")
    print(f"{'seqs':>5} {'inline: engine':>15} {'off: engine':>12} {'off: text (loop)':>17} {'saved':>7}  texts equal")
    for r in rows:
        print(
            f"{r['seqs']:>5} {r['inline_engine_ms']:>15.3f} {r['off_engine_ms']:>12.3f} {r['off_text_ms']:>17.3f}"
            f" {r['engine_saving_ms']:>7.3f}  {r['texts_identical']}"
        )
    if FLAGS.out:
        settings = {n: FLAGS[n].value for n in ("checkpoint", "seqs", "steps", "windows", "stop_share")}
        write_json(PROG, FLAGS.out, {"settings": settings, "rows": rows})
    if not all(r["texts_identical"] for r in rows):
        exit_error(PROG, "the two engines' texts differ", status=1)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
