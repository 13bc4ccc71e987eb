"""Prefix-aware routing over data-parallel replicas vs round-robin, least-loaded and one
big cache, on one multi-tenant multi-turn chat trace.

``--num_replicas`` replica processes (:mod:`jaxkv.fleet.replica`: a tiny model on
CPU, ``--memory`` of KV cache each, small enough that the cache is under pressure)
serve the trace through a :class:`~jaxkv.fleet.router.Router` with each policy in
turn (round-robin, least-loaded, prefix-aware), every replica's prefix cache reset
before each run. The baseline is one cache with the replicas' total memory: one more
replica process, one engine with ``num_replicas x --memory`` and one replica's batch
limits, serving the whole trace alone.

The trace (:func:`jaxkv.serving.workloads.conversations`): ``--num_conversations``
chats, each with one of ``--num_tenants`` system prompts and ``--turns`` user
messages; a follow-up's prompt is the previous turn's prompt + output + a new message.
``--concurrency`` users chat at once (closed loop: a user sends its next turn when the
previous one is answered, and starts a new chat when one ends), starting
``--ramp_s`` apart. Outputs are greedy and the weights identical on every replica, so
every run serves the same prompts whatever the routing.

Reported per run: prefix-cache hit rate (cached prompt tokens / prompt tokens, as the
replicas count them), mean and P90 TTFT (from the router's submit to the first
token), and the ratios prefix-aware / one big cache and prefix-aware / round-robin;
and the trace's hit rate ceiling, that of an unbounded cache (:func:`ceiling_hit_rate`),
which no policy exceeds.
Every replica process is single-threaded (``XLA_FLAGS``). On CPU the TTFTs are a tiny
model's compute and queueing on this machine, to be read as ratios; the routing
policies run the same processes on the same cores, but ``num_replicas`` replicas share
the machine's cores where replicas on separate devices would not, so the big cache's
TTFT (one process, serving alone) is not a like-for-like compute comparison.

``--kill_replica`` then runs the trace once more with prefix-aware routing, kills one
replica (SIGKILL) when half the requests are answered, and reports whether every
request completed, how many were retried, how long after the kill the router dropped
the replica (it drops one that misses a heartbeat, within one
``--heartbeat_interval``), and that the dropped replica's prefixes left the index and
it got nothing after the drop.

    python scripts/bench_route.py --out bench_route.json
    python scripts/bench_route.py --quick          # a short run, for tests

Authentication is on: every socket (requests, heartbeats, KV events and replay) uses
CURVE with keys made for the run (:mod:`jaxkv.serving.zmq_security`). Its cost per
request is measured apart, on this machine, before the replicas start: a 300-token
request and its answer between a DEALER and a ROUTER over ``ipc://``, with and
without CURVE, in turn, best of 5 each (``auth_cost``): the CPU time per request of a
burst (the cost: encryption is CPU work) and the wall time of a round trip (which a
loaded host's scheduling moves by more than that).

Every replica process is killed on any exit (and exits by itself if this script
dies). Bad input prints one line ``bench_route.py: error: ...`` and exits with
status 2.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq
from absl import app, flags, logging

from jaxkv.commands.cli import exit_error, flags_parser, parse_size, pyplot, save_figure, write_json
from jaxkv.errors import JaxkvError
from jaxkv.fleet.protocol import GenerateRequest, GenerateResult, ReplicaAddress
from jaxkv.fleet.replica import ReplicaSpec, running_replicas
from jaxkv.fleet.router import POLICIES, RoutedOutput, Router
from jaxkv.models.tiny import get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.workloads import Conversation, conversations
from jaxkv.serving.zmq_security import ENV_CURVE_DIR, CurveKeys, SecureContext

PROG = "bench_route.py"
FLAGS = flags.FLAGS
flags.DEFINE_integer("num_replicas", 4, "replica processes", lower_bound=2)
flags.DEFINE_enum("model", "tiny-llama", ["tiny-llama", "tiny-hybrid"], "model of every replica")
flags.DEFINE_string("memory", "5MiB", "KV cache of one replica")
flags.DEFINE_integer("max_model_len", 384, "tokens of the longest request", lower_bound=16)
flags.DEFINE_integer("max_num_seqs", 4, "most requests running at once on one replica", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 128, "token budget of one step", lower_bound=1)
flags.DEFINE_integer("num_tenants", 16, "system prompts", lower_bound=1)
flags.DEFINE_integer("system_len", 128, "tokens of a system prompt", lower_bound=1)
flags.DEFINE_integer("num_conversations", 32, "chats in the trace", lower_bound=1)
flags.DEFINE_integer("turns", 4, "user messages per chat", lower_bound=1)
flags.DEFINE_integer("message_len", 48, "tokens of the longest user message (the shortest: half)", lower_bound=2)
flags.DEFINE_integer("max_new_tokens", 16, "tokens generated per turn", lower_bound=1)
flags.DEFINE_integer("concurrency", 10, "users chatting at once", lower_bound=1)
flags.DEFINE_float("ramp_s", 0.2, "seconds between the first turns of the first users", lower_bound=0)
flags.DEFINE_float("load_penalty", 16.0, "prefix-aware routing: tokens of cached prefix one request in flight is worth")
flags.DEFINE_float("heartbeat_interval", 1.0, "seconds between a replica's heartbeats", lower_bound=0.05)
flags.DEFINE_bool("kill_replica", True, "also kill one replica mid-trace and check that every request completes")
flags.DEFINE_bool("quick", False, "a short run (2 replicas, a small trace), for tests")
flags.DEFINE_integer("seed", 0, "weights and trace seed", lower_bound=0)
flags.DEFINE_float("startup_timeout", 300.0, "seconds to wait for the replicas to compile and heartbeat")
flags.DEFINE_string("out", None, "write the results as JSON here")
flags.DEFINE_string("plot", None, "draw hit rate and TTFT per routing policy to this PNG (matplotlib)")
flags.register_validator(
    "load_penalty", lambda v: 0 <= v < float("inf"), message="--load_penalty must be a finite number >= 0"
)
flags.register_validator(
    "startup_timeout", lambda v: 0 < v < float("inf"), message="--startup_timeout must be a finite number > 0"
)

QUICK = {
    "num_replicas": 2,
    "num_tenants": 8,
    "system_len": 64,
    "num_conversations": 8,
    "turns": 2,
    "message_len": 16,
    "max_new_tokens": 4,
    "concurrency": 4,
    "max_model_len": 256,
    "memory": "2MiB",
    "ramp_s": 0.05,
    "heartbeat_interval": 0.5,
}
ONE_THREAD = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
BIG = "one big cache"


@dataclass(frozen=True)
class TraceRun:
    """The answers of one run of the trace, in completion order."""

    outputs: tuple[RoutedOutput, ...]
    wall_s: float

    def summary(self) -> dict[str, float]:
        ttfts = [o.ttft_s for o in self.outputs]
        prompt = sum(len(o.prompt_token_ids) for o in self.outputs)
        return {
            "requests": len(self.outputs),
            "hit_rate": sum(o.num_cached_tokens for o in self.outputs) / prompt,
            "mean_ttft_s": float(np.mean(ttfts)),
            "p90_ttft_s": float(np.percentile(ttfts, 90)),
            "wall_s": self.wall_s,
            "errors": sum(o.error is not None for o in self.outputs),
            "retried": sum(o.attempts > 1 for o in self.outputs),
        }


class Kill:
    """Kills replica ``name`` once ``after`` requests are answered; records when, and
    how many requests the router had sent it when it dropped it."""

    def __init__(self, router: Router, name: str, process: subprocess.Popen, after: int) -> None:
        self.router, self.name, self.process, self.after = router, name, process, after
        self.at: float | None = None
        self.sent_at_drop: int | None = None

    def watch(self, num_answered: int) -> None:
        if self.at is None and num_answered >= self.after:
            self.process.kill()
            self.at = time.monotonic()
        if self.sent_at_drop is None and self.name in self.router.dropped_replicas:
            self.sent_at_drop = self.router.num_sent(self.name)


def run_trace(router: Router, trace: Sequence[Conversation], kill: Kill | None = None) -> TraceRun:
    """Serve ``trace`` with ``--concurrency`` closed-loop users (see the module docstring)."""
    queue = deque(trace)
    chats: dict[str, tuple[Conversation, int, list[int]]] = {}  # request id -> (chat, turn, prompt)
    outputs: list[RoutedOutput] = []

    def send(chat: Conversation, turn: int, prompt: list[int]) -> None:
        chats[router.submit(prompt, FLAGS.max_new_tokens)] = (chat, turn, prompt)

    start = time.monotonic()
    starts = [start + i * FLAGS.ramp_s for i in range(min(FLAGS.concurrency, len(queue)))]
    while chats or starts:
        while starts and time.monotonic() >= starts[0]:
            starts.pop(0)
            chat = queue.popleft()
            send(chat, 0, chat.prompt(0))
        for out in router.poll(0.01):
            chat, turn, prompt = chats.pop(out.request_id)
            outputs.append(out)
            if turn + 1 < chat.num_turns and out.error is None:
                send(chat, turn + 1, chat.prompt(turn + 1, prompt, out.output_token_ids))
            elif queue:
                chat = queue.popleft()
                send(chat, 0, chat.prompt(0))
        if kill is not None:
            kill.watch(len(outputs))
    return TraceRun(tuple(outputs), time.monotonic() - start)


def exchange_us(directory: str, keys: CurveKeys | None, n: int = 2000) -> tuple[float, float]:
    """Microseconds per request over ``ipc://`` (``keys``: CURVE): the wall time of a
    request / answer round trip, and the CPU time of a request and its answer sent in
    a burst of ``n`` (both ends and ZeroMQ's I/O threads, all in this process: what
    encryption costs, without the waits a loaded host adds to a round trip)."""
    request = msgspec.msgpack.encode(GenerateRequest("route-0", list(range(300)), 16))
    answer = msgspec.msgpack.encode(GenerateResult("route-0", "r", list(range(16)), 0.1, 256))
    server_side, client_side = SecureContext(keys), SecureContext(keys)
    endpoint = f"ipc://{directory}/auth-{'curve' if keys else 'plain'}"
    server = server_side.bind(zmq.ROUTER, "server", endpoint, SNDHWM=0, RCVHWM=0)
    client = client_side.connect(zmq.DEALER, "client", endpoint, SNDHWM=0, RCVHWM=0)

    def echo() -> None:
        for _ in range(2 * n + 1):
            identity, _ = server.recv_multipart()
            server.send_multipart((identity, answer))

    thread = threading.Thread(target=echo)
    thread.start()
    client.send(request)
    client.recv()  # the handshake, not timed
    start = time.perf_counter()
    for _ in range(n):
        client.send(request)
        client.recv()
    round_trip = time.perf_counter() - start
    cpu = time.process_time()
    for _ in range(n):
        client.send(request)
    for _ in range(n):
        client.recv()
    cpu = time.process_time() - cpu
    thread.join()
    client.close(linger=0)
    server.close(linger=0)
    client_side.term()
    server_side.term()
    return round_trip / n * 1e6, cpu / n * 1e6


def auth_cost(directory: str, keys: CurveKeys, repeats: int = 5) -> dict[str, float]:
    """CURVE's cost per request: :func:`exchange_us` with and without it, the two
    measured in turn ``repeats`` times (a change of the host's load falls on both),
    best of each."""
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(repeats):
        for curve_on in (False, True):
            runs[curve_on].append(exchange_us(directory, keys if curve_on else None))
    plain = [min(r[i] for r in runs[False]) for i in (0, 1)]
    curve = [min(r[i] for r in runs[True]) for i in (0, 1)]
    return {
        "plain_round_trip_us": plain[0],
        "curve_round_trip_us": curve[0],
        "plain_cpu_per_request_us": plain[1],
        "curve_cpu_per_request_us": curve[1],
        "curve_cost_per_request_us": curve[1] - plain[1],
    }


def engine_args(memory: int, max_num_seqs: int) -> dict[str, object]:
    return {
        "model_name": FLAGS.model,
        "memory_bytes": memory,
        "max_model_len": FLAGS.max_model_len,
        "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "seed": FLAGS.seed,
    }


@contextlib.contextmanager
def router_over(
    names: Sequence[str], specs: dict[str, ReplicaSpec], policy: str, block_size: int, keys: CurveKeys
) -> Iterator[Router]:
    with Router(
        {name: specs[name].address for name in names},
        policy=policy,
        block_size=block_size,
        load_penalty=FLAGS.load_penalty,
        heartbeat_interval_s=FLAGS.heartbeat_interval,
        curve=keys,
    ) as router:
        router.wait_ready(FLAGS.startup_timeout)
        router.reset_prefix_caches()
        yield router


def wait_started(
    specs: dict[str, ReplicaSpec], processes: dict[str, subprocess.Popen], block_size: int, keys: CurveKeys
) -> None:
    """Wait until every replica heartbeats; exit if one of them died on the way."""
    with Router({name: s.address for name, s in specs.items()}, block_size=block_size, curve=keys) as router:
        deadline = time.monotonic() + FLAGS.startup_timeout
        while True:
            dead = [name for name, p in processes.items() if p.poll() is not None]
            if dead:
                exit_error(PROG, f"replica processes {dead} exited while starting", status=1)
            try:
                router.wait_ready(1.0)
                return
            except JaxkvError:
                if time.monotonic() > deadline:
                    raise


def kill_section(
    specs: dict[str, ReplicaSpec],
    processes: dict[str, subprocess.Popen],
    names: Sequence[str],
    trace: Sequence[Conversation],
    block_size: int,
    keys: CurveKeys,
) -> dict[str, object]:
    """Prefix-aware routing with one replica killed mid-trace."""
    expected = sum(c.num_turns for c in trace)
    victim = names[1]
    with router_over(names, specs, "prefix", block_size, keys) as router:
        kill = Kill(router, victim, processes[victim], after=expected // 2)
        run = run_trace(router, trace, kill)
        dropped_at = router.dropped_replicas.get(victim)
        held = sum(victim in {r for r, _ in where} for where in router.index.snapshot().values())
        sent_after_drop = None if kill.sent_at_drop is None else router.num_sent(victim) - kill.sent_at_drop
    return {
        "killed": victim,
        "requests": expected,
        "completed": sum(o.error is None for o in run.outputs),
        "retried": sum(o.attempts > 1 for o in run.outputs),
        "drop_after_kill_s": None if dropped_at is None or kill.at is None else dropped_at - kill.at,
        "heartbeat_interval_s": FLAGS.heartbeat_interval,
        "victim_hashes_in_index": held,
        "sent_to_victim_after_drop": sent_after_drop,
        "all_completed": len(run.outputs) == expected and all(o.error is None for o in run.outputs),
    }


def one_line(summary: dict) -> str:
    """A summary as ``name value`` pairs on one line (rates as %, seconds as ms), not a dict repr."""

    def show(key: str, value: object) -> str:
        if key.endswith("_s") and isinstance(value, float):
            return f"{key[:-2]} {value * 1e3:,.0f} ms"
        if key.endswith("rate") and isinstance(value, float):
            return f"{key} {value:.1%}"
        return f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"

    return ", ".join(show(k, v) for k, v in summary.items())


def plot_results(results: dict[str, dict], path: str) -> None:
    """Hit rate and mean / P90 TTFT of each routing policy (and the one big cache), side by side."""
    plt = pyplot(PROG)
    names = list(results)
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(10, 3.8))
    hits.bar(names, [100 * results[n]["hit_rate"] for n in names], color="tab:green")
    hits.set_ylabel("prefix hit rate (%)")
    xs = range(len(names))
    ttft.bar([x - 0.2 for x in xs], [1e3 * results[n]["mean_ttft_s"] for n in names], 0.4, label="mean")
    ttft.bar([x + 0.2 for x in xs], [1e3 * results[n]["p90_ttft_s"] for n in names], 0.4, label="P90")
    ttft.set_xticks(list(xs), names)
    ttft.set_ylabel("time to first token (ms)")
    ttft.legend()
    for ax in (hits, ttft):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{FLAGS.num_replicas} replicas of {FLAGS.model}, {FLAGS.memory} each; big cache: one replica")
    fig.tight_layout()
    save_figure(PROG, fig, path)


def ceiling_hit_rate(trace: Sequence[Conversation], block_size: int) -> float:
    """The hit rate of an unbounded cache serving ``trace``, an upper bound for every
    routing policy: a chat's first prompt hits its system prompt once a chat of the
    same tenant came before it, a follow-up hits all its previous turn computed (the
    prompt and every output token but the last, never fed back), in whole blocks, a
    prompt's last token never."""
    seen: set[int] = set()
    cached = total = 0
    for chat in trace:
        length = len(chat.prompt(0))
        total += length
        if chat.tenant in seen:
            cached += min(len(chat.system_prompt), length - 1) // block_size * block_size
        seen.add(chat.tenant)
        for turn in range(1, chat.num_turns):
            computed = length + FLAGS.max_new_tokens - 1
            length += FLAGS.max_new_tokens + len(chat.user_messages[turn])
            total += length
            cached += min(computed, length - 1) // block_size * block_size
    return cached / total


def table(results: dict[str, dict], ceiling: float) -> tuple[str, dict[str, float]]:
    lines = ["| routing | hit rate | mean TTFT (ms) | P90 TTFT (ms) | wall (s) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['hit_rate']:.1%} | {r['mean_ttft_s'] * 1e3:,.0f} | {r['p90_ttft_s'] * 1e3:,.0f} "
            f"| {r['wall_s']:.1f} |"
        )
    prefix, rr, big = results["prefix"], results["round_robin"], results[BIG]
    ratios = {
        "hit_rate_prefix_vs_big_cache": prefix["hit_rate"] / big["hit_rate"] if big["hit_rate"] else float("inf"),
        "hit_rate_prefix_vs_round_robin": prefix["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
        "mean_ttft_prefix_vs_big_cache": prefix["mean_ttft_s"] / big["mean_ttft_s"],
        "mean_ttft_prefix_vs_round_robin": prefix["mean_ttft_s"] / rr["mean_ttft_s"],
        "mean_ttft_prefix_vs_least_loaded": prefix["mean_ttft_s"] / results["least_loaded"]["mean_ttft_s"],
        "p90_ttft_prefix_vs_round_robin": prefix["p90_ttft_s"] / rr["p90_ttft_s"],
        "p90_ttft_prefix_vs_least_loaded": prefix["p90_ttft_s"] / results["least_loaded"]["p90_ttft_s"],
    }
    ratios["hit_rate_prefix_vs_ceiling"] = prefix["hit_rate"] / ceiling if ceiling else float("inf")
    lines.append("")
    lines.append(
        f"hit rate ceiling (an unbounded cache): {ceiling:.1%}; prefix-aware reaches 2x round-robin's "
        f"only while round-robin's stays under {ceiling / 2:.1%}"
    )
    lines.extend(f"{k}: {v:.2f}" for k, v in ratios.items())
    return "\n".join(lines), ratios


def check_flags() -> tuple[int, int]:
    """The per-replica memory in bytes and the plan's hash block size; exit 2 on bad input."""
    longest = FLAGS.system_len + FLAGS.turns * (FLAGS.message_len + FLAGS.max_new_tokens)
    if longest > FLAGS.max_model_len:
        exit_error(
            PROG,
            f"a chat reaches {longest} tokens (--system_len + --turns x (--message_len + --max_new_tokens)); "
            f"--max_model_len={FLAGS.max_model_len} is too short",
        )
    try:
        memory = parse_size(FLAGS.memory)
        config = plan_kv_cache(
            get_model_config(FLAGS.model).layer_specs(),
            memory,
            max_model_len=FLAGS.max_model_len,
            options=PlanOptions(max_num_batched_tokens=FLAGS.max_num_batched_tokens),
        )
    except JaxkvError as err:
        exit_error(PROG, err)
    return memory, config.hash_block_size


def main(argv: Sequence[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.quick:
        for name, value in QUICK.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value
    memory, block_size = check_flags()
    if FLAGS.plot:
        pyplot(PROG)  # refuse now, not after the run, if matplotlib is missing
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the replicas are killed
    trace = conversations(
        num_conversations=FLAGS.num_conversations,
        num_tenants=FLAGS.num_tenants,
        system_len=FLAGS.system_len,
        num_turns=FLAGS.turns,
        message_len=(max(1, FLAGS.message_len // 2), FLAGS.message_len),
        vocab_size=get_model_config(FLAGS.model).vocab_size,
        seed=FLAGS.seed,
    )
    n = FLAGS.num_replicas
    print(
        f"{n} replicas of {FLAGS.model} with {FLAGS.memory} of KV cache each; {len(trace)} chats of "
        f"{FLAGS.turns} turns over {FLAGS.num_tenants} system prompts, {FLAGS.concurrency} users at once"
    )
    with tempfile.TemporaryDirectory(prefix="bench_route-") as tmp:
        keys = CurveKeys.generate()
        keys.write(f"{tmp}/keys")
        auth = auth_cost(tmp, keys)
        print(
            f"CURVE authentication: {auth['curve_cost_per_request_us']:.1f} us of CPU per request "
            f"({auth['plain_cpu_per_request_us']:.1f} -> {auth['curve_cpu_per_request_us']:.1f} us; "
            f"round trip {auth['plain_round_trip_us']:.0f} -> {auth['curve_round_trip_us']:.0f} us)"
        )
        names = [f"replica-{i}" for i in range(n)]
        specs = {
            name: ReplicaSpec(
                name, ReplicaAddress.ipc(tmp, name), engine_args(memory, FLAGS.max_num_seqs), FLAGS.heartbeat_interval
            )
            for name in names
        }
        specs[BIG] = ReplicaSpec(
            BIG,
            ReplicaAddress.ipc(tmp, "big"),
            engine_args(n * memory, FLAGS.max_num_seqs),
            FLAGS.heartbeat_interval,
        )
        start = time.monotonic()
        with running_replicas(specs.values(), env={**ONE_THREAD, ENV_CURVE_DIR: f"{tmp}/keys"}) as processes:
            wait_started(specs, processes, block_size, keys)
            print(f"replicas compiled and serving after {time.monotonic() - start:.1f} s")
            results = {}
            for policy in POLICIES:
                with router_over(names, specs, policy, block_size, keys) as router:
                    results[policy] = run_trace(router, trace).summary()
                print(f"{policy}: {one_line(results[policy])}", flush=True)
            with router_over([BIG], specs, "round_robin", block_size, keys) as router:
                results[BIG] = run_trace(router, trace).summary()
            print(f"{BIG}: {one_line(results[BIG])}", flush=True)
            kill = kill_section(specs, processes, names, trace, block_size, keys) if FLAGS.kill_replica else None
    ceiling = ceiling_hit_rate(trace, block_size)
    text, ratios = table(results, ceiling)
    print(text)
    if FLAGS.plot:
        plot_results(results, FLAGS.plot)
    if kill is not None:
        print(f"replica killed mid-trace: {one_line(kill)}")
    if FLAGS.out:
        flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
        report = {
            "flags": flag_values,
            "device": "cpu",
            "results": results,
            "hit_rate_ceiling": ceiling,
            "ratios": ratios,
            "kill_replica": kill,
            "auth": auth,
        }
        write_json(PROG, FLAGS.out, report)
    if any(r["errors"] for r in results.values()) or (kill is not None and not kill["all_completed"]):
        exit_error(PROG, "some requests failed or were lost", status=1)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
