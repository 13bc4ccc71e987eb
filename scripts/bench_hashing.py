"""Benchmark jaxkv block hashing against the naive pickle+sha256 way.

Scenarios, each without extras and with a cache salt + LoRA name:
  prompt        one extend() over a whole prompt held in a Python list;
  prompt_numpy  the same prompt as an int64 numpy array;
  decode        tokens appended one at a time, extend() called after each.

The baseline is the naive scheme (vLLM's old default): per block,
sha256(pickle((parent, tuple(tokens), extra_keys))). Every speed is also given as a
ratio to it, measured in the same run (interleaved, best of --repeats), because
absolute times on shared CPUs are noise. The prompt scenario also shows a floor: only
converting the list to int32 bytes, which any hash of Python ints has to pay; the
decode scenario shows the cost of its loop alone (append + a no-op extend call).

  PYTHONPATH=. python scripts/bench_hashing.py --out /tmp/bench_hashing.json

(PYTHONPATH=. is not needed once jaxkv is installed, e.g. pip install -e .)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
import struct
import sys
import time
from collections.abc import Sequence

import numpy as np
import xxhash
from absl import app, flags

from jaxkv.commands.cli import flags_parser
from jaxkv.core.hashing import HASH_ALGORITHMS, NO_EXTRA_KEYS, BlockHasher, ExtraKeys

PROG = "bench_hashing.py"
FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Write results as JSON to this path.")
flags.DEFINE_integer("num_tokens", 32768, "Tokens per prompt / per decode stream.")
flags.DEFINE_integer("block_size", 16, "Tokens per block.")
flags.DEFINE_integer("repeats", 5, "Timed repeats per case; the best is reported.")
flags.DEFINE_integer("seed", 0, "Seed of the random token stream.")

NAIVE = "naive_pickle_sha256"
FLOOR_CONVERT = "floor_int32_conversion"
FLOOR_LOOP = "floor_loop_no_hashing"
EXTRAS = {
    "none": NO_EXTRA_KEYS,
    "salt+lora": ExtraKeys(cache_salt="tenant-7", lora_name="sql-lora"),
}


class NaiveHasher:
    """The naive scheme: sha256 of a pickled (parent, tokens tuple, extra keys) per block."""

    root = b"\x00" * 32

    def __init__(self, block_size: int):
        self.block_size = block_size

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], extra: ExtraKeys) -> int:
        """Same contract as BlockHasher.extend."""
        bs = self.block_size
        first, last = len(hashes), len(token_ids) // bs
        parent = hashes[-1] if hashes else self.root
        for b in range(first, last):
            keys: tuple[str, ...] = ()
            if extra.lora_name is not None:
                keys += (extra.lora_name,)
            if b == 0 and extra.cache_salt is not None:
                keys += (extra.cache_salt,)
            message = (parent, tuple(token_ids[b * bs : (b + 1) * bs]), keys or None)
            pickled = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            parent = hashlib.sha256(pickled).digest()
            hashes.append(parent)
        return max(0, last - first)


class NoopHasher:
    """Hashes nothing: timing the decode loop with it gives the loop's own cost."""

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], extra: ExtraKeys) -> int:
        """Same signature as BlockHasher.extend; does no work."""
        return 0


Hasher = NaiveHasher | BlockHasher | NoopHasher


def time_prompt(hasher: Hasher, tokens: Sequence[int], extra: ExtraKeys, inner: int) -> tuple[float, list]:
    """Seconds per one-shot extend over `tokens` (mean of `inner` calls)."""
    start = time.perf_counter()
    for _ in range(inner):
        hashes: list[bytes] = []
        hasher.extend(hashes, tokens, extra)
    return (time.perf_counter() - start) / inner, hashes


def time_floor(tokens: list[int], inner: int) -> float:
    """Seconds per list -> int32 bytes conversion (the fastest found; no hashing at all)."""
    fmt = f"<{len(tokens)}I"
    start = time.perf_counter()
    for _ in range(inner):
        struct.pack(fmt, *tokens)
    return (time.perf_counter() - start) / inner


def time_decode(hasher: Hasher, tokens: list[int], extra: ExtraKeys) -> tuple[float, list]:
    """Seconds to feed `tokens` one at a time, calling extend after each."""
    hashes: list[bytes] = []
    stream: list[int] = []
    append, extend = stream.append, hasher.extend
    start = time.perf_counter()
    for t in tokens:
        append(t)
        extend(hashes, stream, extra)
    return time.perf_counter() - start, hashes


def run(num_tokens: int, block_size: int, repeats: int, seed: int) -> dict:
    """Measure every (scenario, extras, algorithm); return the JSON-able results."""
    rng = np.random.default_rng(seed)
    tokens_np = rng.integers(0, 150_000, size=num_tokens, dtype=np.int64)
    tokens = tokens_np.tolist()
    num_blocks = num_tokens // block_size
    inner = max(1, 2**20 // max(num_tokens, 1))
    hashers: dict[str, Hasher] = {NAIVE: NaiveHasher(block_size)}
    hashers.update({algo: BlockHasher(block_size, algo) for algo in HASH_ALGORITHMS})

    best: dict[tuple[str, str, str], float] = {}

    def record(key: tuple[str, str, str], seconds: float) -> None:
        best[key] = min(seconds, best.get(key, float("inf")))

    for _ in range(repeats):
        record(("prompt", "none", FLOOR_CONVERT), time_floor(tokens, inner))
        record(("decode", "none", FLOOR_LOOP), time_decode(NoopHasher(), tokens, NO_EXTRA_KEYS)[0])
        for extras_name, extra in EXTRAS.items():
            for name, hasher in hashers.items():
                seconds, hashes = time_prompt(hasher, tokens, extra, inner)
                record(("prompt", extras_name, name), seconds)
                if name != NAIVE:
                    seconds, np_hashes = time_prompt(hasher, tokens_np, extra, inner)
                    record(("prompt_numpy", extras_name, name), seconds)
                    seconds, dec_hashes = time_decode(hasher, tokens, extra)
                    if not hashes == np_hashes == dec_hashes or len(hashes) != num_blocks:
                        raise AssertionError(f"{name}: prompt, numpy and decode hashes differ")
                else:
                    seconds, _ = time_decode(hasher, tokens, extra)
                record(("decode", extras_name, name), seconds)

    rows = []
    for (scenario, extras_name, name), seconds in best.items():
        base = best[("prompt" if scenario == "prompt_numpy" else scenario, extras_name, NAIVE)]
        rows.append(
            {
                "scenario": scenario,
                "extras": extras_name,
                "algo": name,
                "seconds": seconds,
                "tokens_per_s": num_tokens / seconds,
                "us_per_block": seconds / max(num_blocks, 1) * 1e6,
                "speedup_vs_naive": base / seconds,
            }
        )
    order = {"prompt": 0, "prompt_numpy": 1, "decode": 2}
    rows.sort(key=lambda r: (order[r["scenario"]], r["extras"] != "none", -r["seconds"]))
    return {
        "config": {
            "num_tokens": num_tokens,
            "block_size": block_size,
            "repeats": repeats,
            "seed": seed,
            "baseline": NAIVE,
            "timing": "best of repeats; prompt times are means of inner calls",
            "prompt_inner_calls": inner,
        },
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "numpy": np.__version__,
            "xxhash": xxhash.VERSION,
        },
        "results": rows,
    }


def format_table(results: dict) -> str:
    """The results as a fixed-width text table."""
    lines = [
        f"{'scenario':<13} {'extras':<10} {'algo':<23} {'Mtok/s':>8} {'us/block':>9} {'x naive':>8}",
    ]
    for r in results["results"]:
        lines.append(
            f"{r['scenario']:<13} {r['extras']:<10} {r['algo']:<23} "
            f"{r['tokens_per_s'] / 1e6:>8.2f} {r['us_per_block']:>9.3f} "
            f"{r['speedup_vs_naive']:>8.2f}"
        )
    cfg = results["config"]
    lines.append(
        f"({cfg['num_tokens']} tokens, block_size {cfg['block_size']}, best of {cfg['repeats']}; "
        f"prompt_numpy is compared with the naive hasher on the same prompt as a list)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    results = run(FLAGS.num_tokens, FLAGS.block_size, FLAGS.repeats, FLAGS.seed)
    print(format_table(results))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
