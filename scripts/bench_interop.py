"""Host time per prefix-cache operation: jaxkv inside sglang-jax's seam vs sglang-jax's RadixCache.

One request sequence (``--prompts`` system prompts of ``--shared`` tokens, each request one
of them plus ``--unique`` tokens of its own, then ``--decode`` generated tokens) served one
request at a time the way sglang-jax's scheduler drives its cache, through two stacks:

  jaxkv       :class:`jaxkv.interop.sglang_jax.JaxkvPrefixCache` over a ``KVCacheManager``
              (``match_prefix``, ``inc_lock_ref``, ``alloc`` for the prefill and each
              decode token, ``cache_finished_req``);
  sglang-jax  their ``RadixCache`` with their ``PagedTokenToKVPoolAllocator`` and
              ``ReqToTokenPool`` (``match_prefix``, ``inc_lock_ref``, ``alloc_extend``,
              ``alloc_decode``, ``cache_finished_req``; ``evict`` and a retry when the
              allocator runs out), loaded from a sglang-jax source tree (``--sglang_jax_src``,
              the ``python`` folder of github.com/sgl-project/sglang-jax; it needs ``psutil``).

Both use pages of ``--page_size`` tokens and the same number of pages. The stacks run
``--repeats`` times, interleaved (this machine is noisy); the table gives each operation's
best mean host time (µs per call) per stack, the ratio (sglang-jax / jaxkv, > 1:
jaxkv is faster), and the tokens each stack found cached (the decisions must agree).
Without ``--sglang_jax_src`` only jaxkv's column is measured.

  PYTHONPATH=. python scripts/bench_interop.py --sglang_jax_src=/tmp/sgl-jax/python --out /tmp/bench_interop.json
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from absl import app, flags

from jaxkv.commands.cli import flags_parser
from jaxkv.core import KVCacheManager
from jaxkv.interop.sglang_jax import JaxkvPrefixCache
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec

PROG = "bench_interop.py"
FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 200, "requests served, one after another", lower_bound=1)
flags.DEFINE_integer("prompts", 8, "distinct system prompts the requests share", lower_bound=1)
flags.DEFINE_integer("shared", 256, "tokens of each system prompt", lower_bound=1)
flags.DEFINE_integer("unique", 64, "tokens of each request's own", lower_bound=1)
flags.DEFINE_integer("decode", 16, "tokens generated per request", lower_bound=0)
flags.DEFINE_integer("page_size", 16, "tokens per page (block)", lower_bound=1)
flags.DEFINE_integer("num_pages", 256, "pages in the pool (small enough to evict)", lower_bound=2)
flags.DEFINE_string("sglang_jax_src", None, "sglang-jax's python/ folder (their RadixCache is timed if given)")
flags.DEFINE_integer(
    "repeats", 3, "runs of each stack, interleaved (each operation's best mean is kept)", lower_bound=1
)
flags.DEFINE_bool("quick", False, "a tiny run (20 requests, 4 decode tokens) to check the script")
flags.DEFINE_string("out", None, "write the results as JSON here")


@dataclass
class Req:
    """The fields of sglang-jax's ``Req`` their radix cache and pools read and write."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    dp_rank: int | None = None
    req_pool_idx: int | None = None
    last_node: Any = None
    prefix_indices: Any = None
    cache_protected_len: int = 0
    last_matched_prefix_len: int = 0
    kv_committed_len: int = 0
    kv_committed_freed: bool = False
    is_chunked: int = 0

    def pop_committed_kv_cache(self) -> int:
        self.kv_committed_freed = True
        return self.kv_committed_len


def workload(n: int, decode: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated tokens) per request, deterministic."""
    rng = np.random.default_rng(0)
    systems = [list(range(100_000 * (p + 1), 100_000 * (p + 1) + FLAGS.shared)) for p in range(FLAGS.prompts)]
    out = []
    for i in range(n):
        own = [int(t) for t in rng.integers(1, 50_000, FLAGS.unique)]
        out.append((systems[i % FLAGS.prompts] + own, [int(t) for t in rng.integers(1, 50_000, decode)]))
    return out


class Timer:
    """Mean host time per named operation."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self.total[name] += time.perf_counter() - start
        self.calls[name] += 1
        return out

    def mean_us(self) -> dict[str, float]:
        return {k: self.total[k] / self.calls[k] * 1e6 for k in self.total}


def run_jaxkv(reqs: list[tuple[list[int], list[int]]]) -> tuple[Timer, int]:
    group = KVCacheGroup(("layer",), FullAttentionSpec(num_kv_heads=1, head_size=1), FLAGS.page_size)
    manager = KVCacheManager(KVCacheConfig(num_blocks=FLAGS.num_pages + 1, groups=(group,)), max_model_len=1 << 16)
    cache = JaxkvPrefixCache(manager)
    timer, hit = Timer(), 0
    for i, (prompt, generated) in enumerate(reqs):
        req = Req(f"r{i}", prompt)
        m = timer("match_prefix", cache.match_prefix, _Match(prompt[:-1]))
        req.last_node, req.prefix_indices = m.last_device_node, m.device_indices
        hit += len(m.device_indices)
        timer("inc_lock_ref", cache.inc_lock_ref, req.last_node)
        extend = len(prompt) - len(m.device_indices)
        assert timer("alloc_extend", cache.alloc, req, extend) is not None
        for t in generated:
            req.output_ids.append(t)
            assert timer("alloc_decode", cache.alloc, req, 1) is not None
        timer("cache_finished_req", cache.cache_finished_req, req)
    return timer, hit


@dataclass
class _Match:
    key: list[int]


def run_sglang(reqs: list[tuple[list[int], list[int]]]) -> tuple[Timer, int]:
    base = importlib.import_module("sgl_jax.srt.mem_cache.base_prefix_cache")
    radix = importlib.import_module("sgl_jax.srt.mem_cache.radix_cache")
    allocator_mod = importlib.import_module("sgl_jax.srt.mem_cache.allocator")
    pool_mod = importlib.import_module("sgl_jax.srt.mem_cache.memory_pool")
    page = FLAGS.page_size
    req_pool = pool_mod.ReqToTokenPool(size=16, max_context_len=1 << 12, dtype=np.int32)
    allocator = allocator_mod.PagedTokenToKVPoolAllocator(FLAGS.num_pages * page, page, kvcache=None)
    cache = radix.RadixCache(req_pool, allocator, page_size=page)
    timer, hit = Timer(), 0

    def with_evict(alloc: Callable[[], Any], need: int) -> Any:
        out = alloc()
        if out is None:
            cache.evict(base.EvictParams(num_tokens=need))
            out = alloc()
        assert out is not None, "sglang-jax's pool ran out after evicting"
        return out

    for i, (prompt, generated) in enumerate(reqs):
        req = Req(f"r{i}", prompt)
        m = timer("match_prefix", cache.match_prefix, base.MatchPrefixParams(key=radix.RadixKey(prompt[:-1])))
        prefix = m.device_indices
        req.last_node, req.prefix_indices = m.last_device_node, prefix
        req.cache_protected_len = req.last_matched_prefix_len = len(prefix)
        hit += len(prefix)
        timer("inc_lock_ref", cache.inc_lock_ref, req.last_node)
        req_pool.alloc([req])
        n, seq = len(prefix), len(prompt)
        last = int(prefix[-1]) if n else -1
        slots = timer("alloc_extend", with_evict, partial(allocator.alloc_extend, [n], [seq], [last], seq - n), seq - n)
        req_pool.write((req.req_pool_idx, slice(0, seq)), np.concatenate([prefix, slots]))
        last, length = int(slots[-1]), seq
        for t in generated:
            req.output_ids.append(t)
            length += 1
            slot = timer("alloc_decode", with_evict, partial(allocator.alloc_decode, [length], [last]), page)
            req_pool.write((req.req_pool_idx, slice(length - 1, length)), slot)
            last = int(slot[0])
        req.kv_committed_len = length
        timer("cache_finished_req", cache.cache_finished_req, req)
        req_pool.free(req)
    return timer, hit


def main(argv: list[str]) -> None:
    del argv
    n, decode = (20, 4) if FLAGS.quick else (FLAGS.requests, FLAGS.decode)
    reqs = workload(n, decode)
    runners: dict[str, Callable[[list[tuple[list[int], list[int]]]], tuple[Timer, int]]] = {"jaxkv": run_jaxkv}
    if FLAGS.sglang_jax_src:
        sys.path.insert(0, FLAGS.sglang_jax_src)
        runners["sglang-jax"] = run_sglang
    stacks: dict[str, tuple[dict[str, float], int]] = {}
    for _ in range(FLAGS.repeats):
        for name, run in runners.items():
            timer, hit = run(reqs)
            best = stacks.get(name, ({}, hit))[0]
            stacks[name] = ({op: min(us, best.get(op, us)) for op, us in timer.mean_us().items()}, hit)
            if name == "jaxkv":
                ours = timer
    ops = list(ours.mean_us())
    totals = {name: sum(us * (ours.calls[op]) for op, us in t.items()) / n for name, (t, _) in stacks.items()}
    print(
        f"{n} requests of {FLAGS.shared}+{FLAGS.unique} prompt tokens ({FLAGS.prompts} shared prompts), "
        f"{decode} decode tokens; pages of {FLAGS.page_size}, {FLAGS.num_pages} pages"
    )
    header = " | ".join(f"{name} (µs)" for name in stacks)
    print(f"| operation | calls | {header} | ratio |")
    print("|---|---|" + "---|" * len(stacks) + "---|")
    ratios = {}
    for op in [*ops, "per request"]:
        vals = [totals[name] if op == "per request" else t[op] for name, (t, _) in stacks.items()]
        ratio = vals[1] / vals[0] if len(vals) == 2 else None
        ratios[op] = ratio
        calls = n if op == "per request" else ours.calls[op]
        cells = " | ".join(f"{v:,.1f}" for v in vals)
        print(f"| {op} | {calls:,} | {cells} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    print("cached tokens found: " + ", ".join(f"{name} {hit:,}" for name, (_, hit) in stacks.items()))
    if FLAGS.out:
        flags_used = {k: FLAGS[k].value for k in ("prompts", "shared", "unique", "decode", "page_size", "num_pages")}
        result = {
            "meta": {"python": platform.python_version(), "requests": n},
            "flags": flags_used,
            "mean_us": {name: t for name, (t, _) in stacks.items()},
            "per_request_us": totals,
            "hit_tokens": {name: hit for name, (_, hit) in stacks.items()},
            "ratios": ratios,
        }
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    sys.exit(app.run(main, flags_parser=flags_parser(PROG)))
