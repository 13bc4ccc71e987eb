"""Host offload tier: transfer throughput by layout, and prefix hit rate by policy.

(a) Transfers: a batch of block stores (gather + device->host) and loads (host->device
    + scatter into the donated cache), cross-layer vs per-layer layout, same data, same
    run; copies per block and bytes/s, and the cross/per ratio. On a GPU/TPU the
    host<->device bandwidth of one large copy is measured too and each rate is reported
    as a fraction of it; on CPU that column is left empty (unmeasured).
(b) Policy: block-level multi-turn trace (a request's blocks are its chained hashes)
    whose working set exceeds the device cache. Prefix hit rate (leading blocks found,
    over all requested blocks) for device-only (LRU), device + host tier with LRU and
    with ARC (blocks evicted from the device are stored to the host), an unlimited
    device cache, and Belady's offline optimum for the device + host capacity (the
    ceiling). The same with one-shot scans (unique long prompts) mixed in.

    python scripts/bench_offload.py --out bench_offload.json
"""

from __future__ import annotations

import heapq
import json
import time
from collections import OrderedDict, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxkv import ops
from jaxkv.cache import KVCache, allocate_kv_cache
from jaxkv.offload.host_pool import (
    HostKVPool,
    HostSlotBackend,
    block_nbytes,
    block_shape,
)
from jaxkv.offload.manager import PolicyOffloadingManager
from jaxkv.offload.transfer import TransferEngine, copies_per_block
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_layers", 16, "layers (layer slots) per block")
flags.DEFINE_integer("num_kv_heads", 2, "KV heads")
flags.DEFINE_integer("head_dim", 64, "head size")
flags.DEFINE_integer("block_size", 16, "tokens per block")
flags.DEFINE_integer("batch_blocks", 64, "blocks per store / load batch")
flags.DEFINE_integer("repeats", 5, "timed repeats; the fastest is reported")
flags.DEFINE_integer("device_blocks", 256, "device cache capacity (blocks) in the policy trace")
flags.DEFINE_integer("host_blocks", 1024, "host tier capacity (blocks) in the policy trace")
flags.DEFINE_integer("conversations", 200, "conversations in the multi-turn trace")
flags.DEFINE_integer("turns", 4, "turns per conversation")
flags.DEFINE_integer("active", 24, "conversations interleaved at a time")
flags.DEFINE_integer("scan_every", 3, "scan trace: one one-shot prompt every N requests")
flags.DEFINE_integer("scan_blocks", 96, "blocks of a one-shot scan prompt")
flags.DEFINE_integer("seed", 0, "trace seed")
flags.DEFINE_string("out", None, "write the results as JSON here")


# ------------------------------------------------------------------ (a) transfers
def make_cache(layout: str) -> KVCache:
    spec = FullAttentionSpec(num_kv_heads=FLAGS.num_kv_heads, head_size=FLAGS.head_dim, dtype="float32")
    layers = tuple(f"layer{i}" for i in range(FLAGS.num_layers))
    group = KVCacheGroup(layer_names=layers, spec=spec, block_size=FLAGS.block_size)
    num_blocks = 2 * FLAGS.batch_blocks + 1
    cache = allocate_kv_cache(KVCacheConfig(num_blocks=num_blocks, groups=(group,)), layout=layout)
    data = jax.random.normal(jax.random.key(FLAGS.seed), (num_blocks,) + block_shape(cache), jnp.float32)
    return ops.scatter_blocks(cache, jnp.arange(num_blocks), data)


def best_time(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def host_device_bandwidth(nbytes: int) -> float | None:
    """Bytes/s of one large device->host + host->device round trip; None on CPU."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = jax.sharding.SingleDeviceSharding(device)
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), dev)
    seconds = best_time(lambda: jax.device_put(jax.device_put(x, host), dev).block_until_ready(), FLAGS.repeats)
    return 2 * nbytes / seconds


def time_layout(layout: str) -> dict:
    """Best store and load rates of one batch of blocks for one device layout."""
    n = FLAGS.batch_blocks
    src, dst, slots = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)), list(range(1, n + 1))
    cache = make_cache(layout)
    pool = HostKVPool(n, block_shape(cache), cache.dtype)
    engine = TransferEngine(pool)
    nbytes = n * block_nbytes(cache)

    def store() -> None:
        engine.wait(engine.store(cache, src, slots))

    def load() -> None:
        nonlocal cache
        cache, transfer = engine.load(cache, dst, slots)
        engine.wait(transfer)
        jax.block_until_ready(cache.buffers)

    t_store, t_load = best_time(store, FLAGS.repeats), best_time(load, FLAGS.repeats)
    return {
        "layout": layout,
        "memory_kind": pool.memory_kind,
        "copies_per_block": copies_per_block(cache),
        "block_bytes": block_nbytes(cache),
        "store_bytes_per_s": nbytes / t_store,
        "load_bytes_per_s": nbytes / t_load,
    }


def bench_transfers() -> list[dict]:
    rows = [time_layout(layout) for layout in ("cross_layer", "per_layer")]
    peak = host_device_bandwidth(FLAGS.batch_blocks * rows[0]["block_bytes"])
    for row in rows:
        row["store_frac_of_bw"] = None if peak is None else row["store_bytes_per_s"] / peak
        row["load_frac_of_bw"] = None if peak is None else row["load_bytes_per_s"] / peak
    return rows


# -------------------------------------------------------------------- (b) policy
def chain(parent: int, content: int) -> int:
    return hash((parent, content))


def multi_turn_trace(rng: np.random.Generator, scans: bool) -> list[list[int]]:
    """Requests as lists of chained block hashes; conversations interleave ``active`` at a time."""
    systems = [[] for _ in range(4)]
    for s, blocks in enumerate(systems):
        parent = s
        for i in range(int(rng.integers(16, 48))):
            parent = chain(parent, 10**6 * (s + 1) + i)
            blocks.append(parent)
    contexts = {c: list(systems[rng.integers(len(systems))]) for c in range(FLAGS.conversations)}
    turns_left = {c: FLAGS.turns for c in contexts}
    waiting = list(contexts)
    active: list[int] = []
    trace, fresh = [], 10**9
    while waiting or active:
        while waiting and len(active) < FLAGS.active:
            active.append(waiting.pop(0))
        c = active[int(rng.integers(len(active)))]
        context = contexts[c]
        for _ in range(int(rng.integers(2, 12))):  # previous output + new user turn
            fresh += 1
            context.append(chain(context[-1], fresh))
        trace.append(list(context))
        turns_left[c] -= 1
        if not turns_left[c]:
            active.remove(c)
        if scans and len(trace) % FLAGS.scan_every == 0:
            parent = fresh = fresh + 1
            scan = []
            for _ in range(FLAGS.scan_blocks):
                fresh += 1
                parent = chain(parent, fresh)
                scan.append(parent)
            trace.append(scan)
    return trace


def leading(blocks: list[int], present) -> int:
    for i, b in enumerate(blocks):
        if b not in present:
            return i
    return len(blocks)


def replay(trace: list[list[int]], device_blocks: float, policy: str | None) -> float:
    """Prefix hit rate with a device LRU and, if ``policy``, a host tier fed by device evictions."""
    device: OrderedDict[int, None] = OrderedDict()
    host = None if policy is None else PolicyOffloadingManager(HostSlotBackend(FLAGS.host_blocks), policy)
    hits = total = 0
    for blocks in trace:
        on_device = leading(blocks, device)
        keys = [(b, 0) for b in blocks[on_device:]]
        on_host = 0 if host is None else host.lookup(keys)
        if on_host:
            host.touch(keys[:on_host])
            host.prepare_load(keys[:on_host])
            host.complete_load(keys[:on_host])
        hits += on_device + on_host
        total += len(blocks)
        for b in reversed(blocks):  # the first block ends most recent
            device[b] = None
            device.move_to_end(b)
        evicted = []
        while len(device) > device_blocks:
            evicted.append(device.popitem(last=False)[0])
        if host is not None and evicted:
            out = host.prepare_store([(b, 0) for b in evicted])
            if out is not None:
                host.complete_store(out.keys_to_store)
    return hits / total


def belady(trace: list[list[int]], capacity: int) -> float:
    """Prefix hit rate of one cache of ``capacity`` blocks evicting the furthest next use."""
    accesses = [b for blocks in trace for b in blocks]
    next_use = [0] * len(accesses)
    last: dict[int, int] = defaultdict(lambda: len(accesses))
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = last[accesses[i]]
        last[accesses[i]] = i
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = i = 0
    for blocks in trace:
        in_prefix = True
        for b in blocks:
            in_prefix = in_prefix and b in resident
            hits += in_prefix
            if b not in resident and len(resident) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        del resident[victim]
                        break
            resident[b] = next_use[i]
            heapq.heappush(heap, (-next_use[i], b))
            i += 1
    return hits / len(accesses)


def bench_policies() -> list[dict]:
    rows = []
    for name, scans in (("multi-turn", False), ("multi-turn + scans", True)):
        trace = multi_turn_trace(np.random.default_rng(FLAGS.seed), scans)
        unlimited = replay(trace, float("inf"), None)
        row = {
            "trace": name,
            "requests": len(trace),
            "distinct_blocks": len({b for blocks in trace for b in blocks}),
            "device_only": replay(trace, FLAGS.device_blocks, None),
            "host_lru": replay(trace, FLAGS.device_blocks, "lru"),
            "host_arc": replay(trace, FLAGS.device_blocks, "arc"),
            "unlimited": unlimited,
            "belady": belady(trace, FLAGS.device_blocks + FLAGS.host_blocks),
        }
        row["lru_of_unlimited"] = row["host_lru"] / unlimited
        row["arc_of_unlimited"] = row["host_arc"] / unlimited
        rows.append(row)
    return rows


# ------------------------------------------------------------------------- main
def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value >= 1e3 else f"{value:.3f}"
    return str(value)


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(fmt(row[c]) for c in cols) for row in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    transfers = bench_transfers()
    ratio = {
        kind: transfers[0][f"{kind}_bytes_per_s"] / transfers[1][f"{kind}_bytes_per_s"] for kind in ("store", "load")
    }
    device = jax.devices()[0]
    print(f"(a) transfers of {FLAGS.batch_blocks} blocks on {device.platform} ({device.device_kind})")
    print(table(transfers))
    print(f"cross/per-layer throughput: store {ratio['store']:.2f}x, load {ratio['load']:.2f}x")
    policies = bench_policies()
    print(f"\n(b) prefix hit rate: device {FLAGS.device_blocks} blocks, host {FLAGS.host_blocks} blocks")
    print(table(policies))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"transfers": transfers, "cross_over_per_layer": ratio, "policies": policies}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
