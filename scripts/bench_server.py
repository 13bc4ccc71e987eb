"""Many concurrent streaming clients against the OpenAI-compatible server, caching on and off in one run.

Two servers of the same checkpoint (``--checkpoint DIR``, with a tokenizer) start in
this process on loopback, one with prefix caching and one without (the baseline),
one after the other. Against each, ``--num_clients`` clients each stream
``--requests_per_client`` completions whose prompts start with one of
``--num_prefixes`` shared system prompts and end with a unique question (the
official ``openai`` client, ``stream=True``, ``ignore_eos``). Reported per server:
mean and p90 time to first token (TTFT, to the first streamed text), mean
inter-token latency (ITL, between streamed chunks), output tokens/s, and the prefix
hit rate read from its ``/metrics`` (``vllm:prefix_cache_hits`` / ``_queries``);
then each cached number's ratio to the uncached one. A warm-up round compiles every
step shape before timing. Loopback only; everything is bounded by the flags.

    python scripts/save_tiny_checkpoint.py --family llama --out /tmp/tiny-llama
    python scripts/bench_server.py --checkpoint /tmp/tiny-llama --out bench_server.json

Bad input prints one line ``bench_server.py: error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser, write_json

PROG = "bench_server.py"
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "a checkpoint directory with tokenizer.json")
flags.DEFINE_integer("num_clients", 16, "concurrent clients", lower_bound=1, upper_bound=256)
flags.DEFINE_integer("requests_per_client", 4, "requests each client sends in turn", lower_bound=1, upper_bound=64)
flags.DEFINE_integer("num_prefixes", 2, "distinct shared system prompts", lower_bound=1)
flags.DEFINE_integer("prefix_words", 40, "words in each system prompt", lower_bound=1)
flags.DEFINE_integer("max_tokens", 16, "tokens per completion", lower_bound=1, upper_bound=1024)
flags.DEFINE_string("memory", "8MiB", "KV cache memory of each server")
flags.DEFINE_integer("max_model_len", 512, "longest prompt + output", lower_bound=16)
flags.DEFINE_integer("max_num_seqs", 16, "sequences per step", lower_bound=1)
flags.DEFINE_string("out", None, "write the results as JSON here")

WORDS = ["cache", "block", "prefix", "token", "layer", "window", "state", "page", "host", "device", "memory", "request"]


def prompts() -> list[list[str]]:
    """Per client, its prompts: a shared system prompt and a unique question."""
    systems = [
        f"System {p}: " + " ".join(WORDS[(p + i) % len(WORDS)] for i in range(FLAGS.prefix_words))
        for p in range(FLAGS.num_prefixes)
    ]
    return [
        [f"{systems[(c + r) % len(systems)]}\nQuestion {c}-{r}: why?" for r in range(FLAGS.requests_per_client)]
        for c in range(FLAGS.num_clients)
    ]


class Server:
    """The app for the checkpoint, with caching or without, live on loopback (:class:`ServerThread`)."""

    def __init__(self, caching: bool) -> None:
        from jaxkv.server.cli import ServerThread, build_app, parser

        flags_ = [
            "--checkpoint", FLAGS.checkpoint, "--memory", FLAGS.memory, "--max_model_len", str(FLAGS.max_model_len),
            "--max_num_seqs", str(FLAGS.max_num_seqs), "--max_requests", str(FLAGS.num_clients * 2),
        ]  # fmt: skip
        self.live = ServerThread(
            build_app(parser().parse_args([*flags_, *([] if caching else ["--no_prefix_caching"])]))
        )
        self.url = self.live.url

    def counters(self) -> dict[str, float]:
        """The Prometheus counters of ``/metrics`` by name."""
        from urllib.request import urlopen

        text = urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_:]+)\{[^}]*\} (\S+)$", text, re.M)}

    def close(self) -> None:
        self.live.close()


async def client_run(url: str, texts: Sequence[str]) -> list[dict[str, float]]:
    """One client's requests in turn: TTFT, inter-token gaps, tokens of each."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = []
    for text in texts:
        start = time.perf_counter()
        times = []
        tokens = 0
        stream = await client.completions.create(
            model="m",
            prompt=text,
            max_tokens=FLAGS.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        gaps = [b - a for a, b in itertools.pairwise(times)]
        out.append({"ttft_s": times[0] - start, "itl_s": statistics.fmean(gaps) if gaps else 0.0, "tokens": tokens})
    await client.close()
    return out


async def load(url: str, work: list[list[str]]) -> tuple[list[dict[str, float]], float]:
    start = time.perf_counter()
    runs = await asyncio.gather(*(client_run(url, texts) for texts in work))
    return [r for run in runs for r in run], time.perf_counter() - start


def measure(caching: bool) -> dict[str, Any]:
    server = Server(caching)
    try:
        warm = [[f"warm-up {c}: " + " ".join(WORDS)] for c in range(min(FLAGS.num_clients, FLAGS.max_num_seqs))]
        asyncio.run(load(server.url, warm))
        before = server.counters()
        results, wall = asyncio.run(load(server.url, prompts()))
        after = server.counters()
    finally:
        server.close()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    ttfts = sorted(r["ttft_s"] for r in results)
    return {
        "requests": len(results),
        "mean_ttft_s": statistics.fmean(ttfts),
        "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "mean_itl_s": statistics.fmean(r["itl_s"] for r in results),
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "wall_s": wall,
    }


def main(argv: Sequence[str]) -> None:
    if FLAGS.checkpoint is None or not (Path(FLAGS.checkpoint) / "tokenizer.json").exists():
        exit_error(PROG, f"--checkpoint={FLAGS.checkpoint} must be a checkpoint directory with a tokenizer.json")
    try:
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        exit_error(PROG, f"needs the server extra and openai (pip install 'jaxkv[server]' openai): {err}")
    for name in ("httpx", "httpx2"):  # one log line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    report = {"cached": measure(True), "uncached": measure(False)}
    names = list(report["cached"])
    print(f"{'':22}{'cached':>14}{'uncached':>14}{'ratio':>10}")
    for name in names[1:]:
        cached, uncached = report["cached"][name], report["uncached"][name]
        ratio = cached / uncached if uncached else float("nan")
        print(f"{name:22}{cached:>14.4f}{uncached:>14.4f}{ratio:>10.2f}")
    if FLAGS.out:
        write_json(PROG, FLAGS.out, report)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
