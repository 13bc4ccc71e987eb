"""Host offload tier: transfer throughput by layout, and prefix hit rate by policy.

(a) Transfers: a batch of 64 block stores (device gather + one DMA per block into the
    pinned_host buffers) and loads (one DMA per block out of it + scatter into the donated
    cache) through the transfer engine, for cross-layer blocks of 16 KiB, 128 KiB and
    2 MiB (fp32, 16 layers), cross-layer vs per-layer layout, same data, same run; and
    the per-layer cache moved one layer buffer at a time (a gather and a host write per
    layer, the way each layer's pages travel when layers are separate arrays). Every
    rate is also a fraction of the baseline measured in the same run: one
    ``jax.device_put`` of a contiguous array of the same bytes to pinned_host (store)
    and back (load). On CPU host and device are the same DRAM: only the ratios and the
    structure mean anything there.
(b) Policy: block-level multi-turn trace (a request's blocks are its chained hashes)
    whose working set exceeds the device cache. Prefix hit rate (leading blocks found,
    over all requested blocks) for device-only (LRU), device + host tier with LRU and
    with ARC, an unlimited device cache, and Belady's offline optimum for the device +
    host capacity (the ceiling); the same with one-shot scans (unique long prompts)
    mixed in. Each host size is run with both store policies of the connector: on
    eviction (a block reaches host when the device reuses it) and write-through (every
    block once it is filled); "stored" counts the blocks each copied to host.
(c) Serving: the tiny model served by the engine on a multi-turn chat (conversations
    share a system prompt; each turn resends the whole context plus a new user
    message; conversations take turns, so their contexts outgrow the device cache).
    Prefix hit rate and mean time-to-first-token for device only, device + host (LRU,
    ARC) and an unlimited device cache, tokens checked identical. The workload runs
    twice per engine with different prompts; the second run is timed (every shape
    compiled, caches warm). On CPU the TTFTs are a tiny model's compute against
    memcpy: only the ratios of one run mean anything.

    python scripts/bench_offload.py --out bench_offload.json
    python scripts/bench_offload.py --sections=transfers   # (a) only
    python scripts/bench_offload.py --sections=policies --plot /tmp/policies.png   # (b) drawn
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxkv import ops
from jaxkv.benchmarks.timing import best_seconds
from jaxkv.commands.cli import exit_error, flags_parser, pyplot, save_figure
from jaxkv.device.cache import KVCache, allocate_kv_cache
from jaxkv.device.metadata import Buckets
from jaxkv.models.tiny import MODEL_CONFIGS, TinyLM, get_model_config
from jaxkv.offload.catalog import PolicyOffloadingManager
from jaxkv.offload.host_blocks import HostBlockBackend
from jaxkv.offload.host_buffers import HostKVBuffers, block_nbytes, block_shape
from jaxkv.offload.transfer import TransferEngine, copies_per_block
from jaxkv.planner import KVCacheConfig, KVCacheGroup, PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.offload_connector import STORE_POLICIES, OffloadConfig
from jaxkv.specs import FullAttentionSpec

PROG = "bench_offload.py"
FLAGS = flags.FLAGS
flags.DEFINE_integer("num_layers", 16, "layers (layer slots) per block")
flags.DEFINE_list(
    "block_bytes", ["16384", "131072", "2097152"], "(a) bytes of one cross-layer block (fp32), one row set each"
)
flags.DEFINE_integer("block_size", 16, "tokens per block")
flags.DEFINE_integer("batch_blocks", 64, "blocks per store / load batch")
flags.DEFINE_integer("repeats", 5, "timed repeats; the fastest is reported")
flags.DEFINE_integer("device_blocks", 256, "device cache capacity (blocks) in the policy trace")
flags.DEFINE_list("host_blocks", ["256", "1024"], "host tier capacities (blocks) in the policy trace")
flags.DEFINE_integer("conversations", 200, "conversations in the multi-turn trace")
flags.DEFINE_integer("turns", 4, "turns per conversation")
flags.DEFINE_integer("active", 24, "conversations interleaved at a time")
flags.DEFINE_integer("scan_every", 3, "scan trace: one one-shot prompt every N requests")
flags.DEFINE_integer("scan_blocks", 96, "blocks of a one-shot scan prompt")
flags.DEFINE_integer("seed", 0, "trace seed")
flags.DEFINE_enum("serve_model", "tiny-llama", list(MODEL_CONFIGS), "(c) model")
flags.DEFINE_integer("serve_conversations", 6, "(c) conversations")
flags.DEFINE_integer("serve_turns", 4, "(c) turns per conversation")
flags.DEFINE_integer("serve_system_len", 256, "(c) tokens of the shared system prompt")
flags.DEFINE_integer("serve_user_len", 48, "(c) tokens of each user message")
flags.DEFINE_integer("serve_new_tokens", 8, "(c) tokens generated per turn")
flags.DEFINE_integer("serve_device_blocks", 64, "(c) device cache blocks")
flags.DEFINE_integer("serve_host_blocks", 512, "(c) host tier blocks")
flags.DEFINE_list(
    "sections", ["transfers", "policies", "serving"], "which of (a) transfers, (b) policies, (c) serving to run"
)
flags.DEFINE_string("out", None, "write the results as JSON here")
flags.DEFINE_string("plot", None, "(b): draw the policies' hit rates side by side to this PNG (matplotlib)")

POLICY_BARS = {
    "device_only": "device only (LRU)",
    "host_lru": "+ host, LRU",
    "host_arc": "+ host, ARC",
    "belady": "Belady, device + host",
    "unlimited": "unlimited device",
}


# ------------------------------------------------------------------ (a) transfers
def block_geometry(block_bytes: int) -> tuple[int, int]:
    """(KV heads, head size) giving fp32 blocks of ``block_bytes`` over the flagged layers
    and block size: head size 64 with more heads for large blocks, fewer lanes for small."""
    per_head = FLAGS.num_layers * FLAGS.block_size * 2 * 4  # bytes per KV head per unit of head size
    heads, head_dim = (
        (block_bytes // (per_head * 64), 64) if block_bytes >= per_head * 64 else (1, block_bytes // per_head)
    )
    if heads * head_dim * per_head != block_bytes:
        raise ValueError(f"block_bytes {block_bytes} is not {per_head} * heads * head size")
    return heads, head_dim


def make_cache(layout: str, block_bytes: int) -> KVCache:
    heads, head_dim = block_geometry(block_bytes)
    spec = FullAttentionSpec(num_kv_heads=heads, head_size=head_dim, dtype="float32")
    layers = tuple(f"layer{i}" for i in range(FLAGS.num_layers))
    group = KVCacheGroup(layer_names=layers, spec=spec, block_size=FLAGS.block_size)
    num_blocks = 2 * FLAGS.batch_blocks + 1
    cache = allocate_kv_cache(KVCacheConfig(num_blocks=num_blocks, groups=(group,)), layout=layout)
    data = jax.random.normal(jax.random.key(FLAGS.seed), (num_blocks, *block_shape(cache)), jnp.float32)
    return ops.scatter_blocks(cache, jnp.arange(num_blocks), data)


def bulk_copy(nbytes: int) -> dict:
    """The baseline: one ``jax.device_put`` of a contiguous array of ``nbytes`` to
    pinned_host (store direction) and one back to the device (load direction)."""
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = jax.sharding.SingleDeviceSharding(device)
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), dev)
    on_host = jax.device_put(x, host)
    t_store = best_seconds(lambda: jax.device_put(x, host), FLAGS.repeats)
    t_load = best_seconds(lambda: jax.device_put(on_host, dev), FLAGS.repeats)
    return {"store_bytes_per_s": nbytes / t_store, "load_bytes_per_s": nbytes / t_load}


def transfer_row(way: str, cache: KVCache, copies: int, memory_kind: str, t_store: float, t_load: float) -> dict:
    nbytes = FLAGS.batch_blocks * block_nbytes(cache)
    return {
        "block_bytes": block_nbytes(cache),
        "way": way,
        "page_bytes": block_nbytes(cache) // cache.num_layers_per_block,
        "memory_kind": memory_kind,
        "copies_per_block": copies,
        "store_bytes_per_s": nbytes / t_store,
        "load_bytes_per_s": nbytes / t_load,
    }


def time_layout(layout: str, block_bytes: int) -> dict:
    """Best store and load times of one batch of blocks through the transfer engine."""
    n = FLAGS.batch_blocks
    src, dst, slots = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)), list(range(1, n + 1))
    cache = make_cache(layout, block_bytes)
    pool = HostKVBuffers(n, block_shape(cache), cache.dtype)
    engine = TransferEngine(pool)

    def store() -> None:
        engine.wait(engine.store(cache, src, slots))

    def load() -> None:
        nonlocal cache
        cache, _ = engine.load(cache, dst, slots)
        jax.block_until_ready(cache.buffers)

    t_store, t_load = best_seconds(store, FLAGS.repeats), best_seconds(load, FLAGS.repeats)
    return transfer_row(layout, cache, copies_per_block(cache), pool.memory_kind, t_store, t_load)


def time_layer_by_layer(block_bytes: int) -> dict:
    """A per-layer cache stored and loaded one layer buffer at a time (the way each
    layer's pages travel when layers are separate arrays and are not staged together).

    One host buffers per layer (the same pool code), one gather + host write per layer to
    store, one host read + scatter per layer to load.
    """
    n = FLAGS.batch_blocks
    src, dst, slots = jnp.arange(1, n + 1), jnp.arange(n + 1, 2 * n + 1), np.arange(1, n + 1)
    cache = make_cache("per_layer", block_bytes)
    pools = [HostKVBuffers(n, b.shape[1:], b.dtype) for b in cache.buffers]
    gather = jax.jit(lambda buffer, ids: buffer[ids])
    scatter = jax.jit(lambda buffer, ids, rows: buffer.at[ids].set(rows), donate_argnums=0)
    buffers = list(cache.buffers)

    def store() -> None:
        for pool, buffer in zip(pools, buffers, strict=True):
            if pool.memory_kind == "pinned_host":
                pool.write(slots, gather(buffer, src))
            else:
                pool.commit(slots, np.asarray(gather(buffer, src)))
        for pool in pools:
            pool.block_until_ready()

    def load() -> None:
        nonlocal buffers
        buffers = [scatter(b, dst, pool.read(slots)) for b, pool in zip(buffers, pools, strict=True)]
        jax.block_until_ready(buffers)

    t_store, t_load = best_seconds(store, FLAGS.repeats), best_seconds(load, FLAGS.repeats)
    return transfer_row(
        "per_layer, layer by layer", cache, cache.num_layers_per_block, pools[0].memory_kind, t_store, t_load
    )


def bench_transfers() -> tuple[list[dict], list[dict]]:
    """Transfer rows per block size, each rate also as a fraction of the bulk copy of the
    same bytes (measured in the same run), and the cross-layer ratios of each size."""
    rows, ratios = [], []
    for block_bytes in map(int, FLAGS.block_bytes):
        bulk = bulk_copy(FLAGS.batch_blocks * block_bytes)
        ways = [time_layout("cross_layer", block_bytes), time_layout("per_layer", block_bytes)]
        ways.append(time_layer_by_layer(block_bytes))
        rows.append(
            {
                "block_bytes": block_bytes,
                "way": "bulk copy (baseline)",
                **bulk,
                "store_of_bulk": 1.0,
                "load_of_bulk": 1.0,
            }
        )
        for row in ways:
            for kind in ("store", "load"):
                row[f"{kind}_of_bulk"] = row[f"{kind}_bytes_per_s"] / bulk[f"{kind}_bytes_per_s"]
        rows += ways
        cross, per_layer, by_layer = ways
        ratio = {"block_bytes": block_bytes}
        for kind in ("store", "load"):
            ratio[f"cross_{kind}_of_bulk"] = cross[f"{kind}_of_bulk"]
            ratio[f"layer_by_layer_{kind}_of_cross"] = by_layer[f"{kind}_bytes_per_s"] / cross[f"{kind}_bytes_per_s"]
            ratio[f"per_layer_{kind}_of_cross"] = per_layer[f"{kind}_bytes_per_s"] / cross[f"{kind}_bytes_per_s"]
        ratios.append(ratio)
    return rows, ratios


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


def replay(
    trace: list[list[int]], device_blocks: float, policy: str | None, host_blocks: int = 0, store: str = ""
) -> tuple[float, int]:
    """Prefix hit rate and blocks stored, with a device LRU and, if ``policy``, a host tier.

    ``store`` is the connector's store policy: ``on_eviction`` stores the blocks the
    device evicts, ``write_through`` every block of a request once it is computed.
    """
    device: OrderedDict[int, None] = OrderedDict()
    host = None if policy is None else PolicyOffloadingManager(HostBlockBackend(host_blocks), policy)
    hits = total = stored = 0
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
        to_store = evicted if store == "on_eviction" else blocks
        if host is not None and to_store:
            out = host.prepare_store([(b, 0) for b in to_store])
            if out is not None:
                host.complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
    return hits / total, stored


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
        unlimited, _ = replay(trace, float("inf"), None)
        device_only, _ = replay(trace, FLAGS.device_blocks, None)
        for host_blocks in map(int, FLAGS.host_blocks):
            ceiling = belady(trace, FLAGS.device_blocks + host_blocks)
            for store in STORE_POLICIES:
                (lru, lru_stored), (arc, arc_stored) = (
                    replay(trace, FLAGS.device_blocks, policy, host_blocks, store) for policy in ("lru", "arc")
                )
                rows.append(
                    {
                        "trace": name,
                        "host_blocks": host_blocks,
                        "store": store,
                        "device_only": device_only,
                        "host_lru": lru,
                        "host_arc": arc,
                        "unlimited": unlimited,
                        "belady": ceiling,
                        "lru_of_unlimited": lru / unlimited,
                        "arc_of_unlimited": arc / unlimited,
                        "stored_lru": lru_stored,
                        "stored_arc": arc_stored,
                    }
                )
    return rows


def plot_policies(rows: list[dict], path: str) -> None:
    """(b) as grouped bars: one panel per trace, one group per host size and store policy."""
    plt = pyplot(PROG)
    traces = list(dict.fromkeys(row["trace"] for row in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), sharey=True, squeeze=False)
    width = 0.8 / len(POLICY_BARS)
    for ax, trace in zip(axes[0], traces, strict=True):
        group = [row for row in rows if row["trace"] == trace]
        for i, (key, label) in enumerate(POLICY_BARS.items()):
            xs = [g + (i - (len(POLICY_BARS) - 1) / 2) * width for g in range(len(group))]
            ax.bar(xs, [100 * row[key] for row in group], width, label=label)
        ax.set_xticks(range(len(group)))
        ax.set_xticklabels([f"host {row['host_blocks']}\n{row['store']}" for row in group])
        ax.set_title(f"{trace} (device {FLAGS.device_blocks} blocks)")
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("prefix hit rate (% of requested blocks)")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    save_figure(PROG, fig, path)


# ------------------------------------------------------------------- (c) serving
def chat(engine: Engine, seed: int) -> tuple[list[float], int, int, list[list[int]]]:
    """Serve the multi-turn chat one request at a time: TTFTs, cached and prompt tokens, outputs."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.vocab_size
    system = rng.integers(0, vocab, FLAGS.serve_system_len).tolist()
    contexts = [
        system + rng.integers(0, vocab, FLAGS.serve_user_len).tolist() for _ in range(FLAGS.serve_conversations)
    ]
    ttfts, outputs, cached, prompt_tokens = [], [], 0, 0
    for _ in range(FLAGS.serve_turns):
        for c, context in enumerate(contexts):
            out = engine.generate([context], FLAGS.serve_new_tokens).outputs[0]
            ttfts.append(out.ttft_s)
            outputs.append(list(out.output_token_ids))
            cached += out.num_cached_tokens
            prompt_tokens += len(context)
            contexts[c] = context + outputs[-1] + rng.integers(0, vocab, FLAGS.serve_user_len).tolist()
    return ttfts, cached, prompt_tokens, outputs


def bench_serving() -> list[dict]:
    model = TinyLM(get_model_config(FLAGS.serve_model), seed=FLAGS.seed)
    specs = model.config.layer_specs()
    turn = FLAGS.serve_user_len + FLAGS.serve_new_tokens
    max_model_len = FLAGS.serve_system_len + FLAGS.serve_turns * turn
    vllm_rule = PlanOptions(max_num_batched_tokens=256, state_layout="attention_pages")
    block_bytes = plan_kv_cache(specs, 1 << 30, max_model_len=max_model_len, options=vllm_rule).pages.block_bytes

    def engine(device_blocks: int, policy: str | None) -> Engine:
        plan = plan_kv_cache(
            specs,
            device_blocks * block_bytes,
            max_model_len=max_model_len,
            options=vllm_rule,
        )
        offload = None if policy is None else OffloadConfig(FLAGS.serve_host_blocks * block_bytes, policy=policy)
        max_blocks = plan.blocks_per_request()[0]
        # Power-of-two token buckets, so a cached request's short prefill runs a small step.
        buckets = Buckets(Buckets.powers_of_two(256, 1, max_blocks).tokens, (1,), (max_blocks,))
        return Engine(model, plan, max_num_seqs=1, buckets=buckets, offload=offload)

    unlimited_blocks = 2 * FLAGS.serve_conversations * (max_model_len // 16 + 2)
    configs = {
        "device only": engine(FLAGS.serve_device_blocks, None),
        "device + host LRU": engine(FLAGS.serve_device_blocks, "lru"),
        "device + host ARC": engine(FLAGS.serve_device_blocks, "arc"),
        "unlimited device": engine(unlimited_blocks, None),
    }
    rows, reference = [], None
    with ops.set_implementation("xla_gpu"):
        for name, eng in configs.items():
            if eng.connector is not None:
                max_blocks = eng.runner.cache.num_blocks
                eng.runner.cache = eng.connector.transfers.warm_up(eng.runner.cache, max_blocks)
            chat(eng, FLAGS.seed + 1)  # warm-up: compiles every step shape, fills the caches
            ttfts, cached, prompt_tokens, outputs = chat(eng, FLAGS.seed + 2)
            reference = reference or outputs
            rows.append(
                {
                    "config": name,
                    "prefix_hit_rate": cached / prompt_tokens,
                    "mean_ttft_s": float(np.mean(ttfts)),
                    "loaded_tokens": eng.connector.stats.num_loaded_tokens if eng.connector else 0,
                    "tokens_identical": outputs == reference,
                }
            )
    for row in rows:
        row["ttft_vs_device_only"] = rows[0]["mean_ttft_s"] / row["mean_ttft_s"]
    return rows


# ------------------------------------------------------------------------- main
def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value >= 1e3 else f"{value:.3f}"
    return str(value)


def table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(col for row in rows for col in row))
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(fmt(row.get(c)) for c in cols) for row in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.plot:
        if "policies" not in FLAGS.sections:
            exit_error(PROG, "--plot draws section (b): add policies to --sections")
        pyplot(PROG)  # refuse now, not after the run, if matplotlib is missing
    results = {}
    if "transfers" in FLAGS.sections:
        transfers, ratios = bench_transfers()
        device = jax.devices()[0]
        print(
            f"(a) transfers of {FLAGS.batch_blocks} blocks of {FLAGS.num_layers} layers "
            f"on {device.platform} ({device.device_kind}); *_of_bulk: over one device_put of the same bytes"
        )
        print(table(transfers))
        print("\ncross-layer over the bulk copy, and the per-layer ways over cross-layer")
        print(table(ratios))
        results.update(transfers=transfers, cross_layer_ratios=ratios)
    if "policies" in FLAGS.sections:
        print("\n(b) replaying the block traces (Belady's optimum takes longest) ...", flush=True)
        policies = bench_policies()
        print(f"(b) prefix hit rate: device {FLAGS.device_blocks} blocks")
        print(table(policies))
        results["policies"] = policies
        if FLAGS.plot:
            plot_policies(policies, FLAGS.plot)
    if "serving" in FLAGS.sections:
        print("\n(c) serving: compiling and running each engine twice ...", flush=True)
        serving = bench_serving()
        print(
            f"\n(c) serving {FLAGS.serve_model}: {FLAGS.serve_conversations} conversations x {FLAGS.serve_turns} "
            f"turns, device {FLAGS.serve_device_blocks} blocks, host {FLAGS.serve_host_blocks} blocks"
        )
        print(table(serving))
        results["serving"] = serving
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
