"""Prefix hit rate of ``jaxkv-server`` replicas behind the routers people run (vllm-router,
sglang-router) vs one big cache, with the router started after the replicas cached and
kept across a replica restart.

``--num_replicas`` ``jaxkv-server`` processes of one checkpoint (``--memory`` of KV cache
each; every server, router and socket on 127.0.0.1) serve a multi-turn chat trace:
``--num_conversations`` chats over ``--num_tenants`` shared system prompts, ``--turns``
turns each, sent turn by turn (every chat's turn 1, then every chat's turn 2, ...):

1. turn 1 goes straight to the replicas, round robin, before any router runs (the
   replicas cache first: the normal case for a router that restarts or joins late);
2. the router starts (``kv_aware`` is given every replica's KV event and replay
   endpoints and ``--kv-event-block-size``; its index comes from the replay); turn 2
   goes through it;
3. one replica is killed and started again on the same ports (its cache and its event
   numbering start from 0); the later turns go through the same router.

The hit rate is the servers' own ``vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`` (tokens) over the routed turns, summed over every
process (the restarted one's counters read before it is killed). "one big cache" is one
server with the replicas' memory together serving the same turns; "ratio" is a policy's
hit rate over it, in the same run. Requests go one at a time (a bounded loop), so the
routing decisions, not the load, make the difference.

    python scripts/save_tiny_checkpoint.py --family llama --out /tmp/tiny-llama
    PYTHONPATH=. python scripts/bench_routers.py --checkpoint /tmp/tiny-llama \\
        --routers_venv /tmp/routers-venv --out bench_routers.json

The routers come from ``pip install 'jaxkv[fleet]'`` (vllm-router; sglang-router by
hand) in the environment ``--routers_venv`` names (its ``bin/``); a router that is not
installed is reported as skipped, with the reason.

``--host_tiers none,memory,file`` runs each configuration once per host tier: none;
``memory`` (``jaxkv-server --kv_offloading_size`` of ``--kv_offloading_size`` each, stored
on eviction); ``file`` (the same kept in a file per replica, ``--kv_offloading_path``,
written through: the restarted replica reloads it and announces the reloaded blocks);
``shared`` (the same files, in one directory, each replica reading the others' as peers,
``--kv_offloading_peers DIR/*.kv``: a prefix hit copies the blocks its own tiers lack from
another replica's file, so a request routed away from its chat's replica still hits).
With a host tier the hit rate counts the host tier's hits too
(``vllm:external_prefix_cache_hits_total``), and one big cache gets the replicas' host
memory together (in memory: it is never restarted), so the comparison stays fair on bytes:

    PYTHONPATH=. python scripts/bench_routers.py --checkpoint /tmp/tiny-llama \\
        --routers_venv /tmp/routers-venv --host_tiers none,memory,file --out bench_routers_host.json
    PYTHONPATH=. python scripts/bench_routers.py --checkpoint /tmp/tiny-llama --routers_venv /tmp/routers-venv \\
        --configs vllm:kv_aware,vllm:cache_aware --host_tiers file,shared --out bench_routers_shared.json

With ``shared`` the fleet holds the same bytes as one big cache +host (each replica its own
``--kv_offloading_size``; a block copied from a peer takes a host block of the copier's own).

A hybrid checkpoint (recurrent layers: ``--family qwen3_next``) is served with
state-aware KV events by default; ``--kv_events state_aware,raw`` runs ``kv_aware`` once
per event stream (``raw``: ``jaxkv-server --kv_events_raw``, every group's blocks and
checkpoints as recorded). For ``kv_aware`` the table adds the prompt tokens the router
credited the chosen replica with (its ``credited_prefix_tokens``, read from its debug
log, decision by decision) and those of them the replica then recomputed (credited
minus the request's ``cached_tokens``, where positive):

    python scripts/save_tiny_checkpoint.py --family qwen3_next --out /tmp/tiny-qwen3-next
    PYTHONPATH=. python scripts/bench_routers.py --checkpoint /tmp/tiny-qwen3-next \\
        --configs vllm:kv_aware --kv_events state_aware,raw --out bench_routers_hybrid.json
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser
from jaxkv.server.cli import parse_bytes

flags.DEFINE_string("checkpoint", None, "a tiny Hugging Face-format checkpoint with a tokenizer (required)")
flags.DEFINE_string("routers_venv", "/tmp/routers-venv", "the environment holding vllm-router / sglang-router")
flags.DEFINE_list("configs", ["vllm:cache_aware", "vllm:kv_aware", "sglang:cache_aware", "vllm:round_robin"], "")
flags.DEFINE_integer("num_replicas", 3, "jaxkv-server replicas", lower_bound=2)
flags.DEFINE_string("memory", "1MiB", "KV cache of one replica (one big cache: all of theirs)")
flags.DEFINE_integer("num_tenants", 4, "shared system prompts", lower_bound=1)
flags.DEFINE_integer("system_chars", 200, "characters of a system prompt", lower_bound=1)
flags.DEFINE_integer("num_conversations", 24, "chats in the trace", lower_bound=1)
flags.DEFINE_integer("turns", 3, "turns per chat (turn 1 warms the replicas)", lower_bound=2)
flags.DEFINE_integer("user_chars", 40, "characters of a user message", lower_bound=1)
flags.DEFINE_integer("max_tokens", 4, "tokens generated per turn", lower_bound=1)
flags.DEFINE_integer("seed", 0, "trace seed")
flags.DEFINE_float("start_timeout", 120.0, "seconds a server or router may take to start")
flags.DEFINE_string("out", None, "write the results as JSON here")
flags.DEFINE_float("router_settle_s", 3.0, "seconds a router runs before the first routed request", lower_bound=0)
flags.DEFINE_string("router_logs", None, "write each router's output here")
flags.DEFINE_list(
    "kv_events",
    ["state_aware"],
    "event streams kv_aware runs with: state_aware (the default), raw (a hybrid's per-group events as recorded)",
)
flags.DEFINE_string("kv_offloading_size", "2MiB", "host tier of one replica (one big cache: all of theirs)")
flags.DEFINE_list(
    "host_tiers",
    ["none"],
    "host tiers each configuration runs with: none, memory (--kv_offloading_size), file (the same, kept in a file "
    "per replica with --kv_offloading_path, so the restarted replica reloads it), shared (the files, each replica "
    "reading the others' with --kv_offloading_peers)",
)
flags.DEFINE_enum(
    "kv_offloading_store",
    None,
    ["on_eviction", "write_through"],
    "the replicas' --kv_offloading_store (default: the server's, write_through with a file)",
)
FLAGS = flags.FLAGS
HOST_TIERS = ("none", "memory", "file", "shared")
PROG = "bench_routers.py"

HOST = "127.0.0.1"
WIDTH = 34
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "river", "stone", "cloud", "light")
REPLY = "noted, go on"
"""What the client resends as the assistant's turn (the tiny model's text is noise)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


def trace() -> list[list[list[dict[str, str]]]]:
    """Per turn, per chat, the messages of that turn's request."""
    rng = random.Random(FLAGS.seed)
    systems = [f"tenant {t}: " + text(rng, FLAGS.system_chars) for t in range(FLAGS.num_tenants)]
    chats = [[{"role": "system", "content": systems[c % FLAGS.num_tenants]}] for c in range(FLAGS.num_conversations)]
    turns = []
    for _ in range(FLAGS.turns):
        requests = []
        for chat in chats:
            chat.append({"role": "user", "content": text(rng, FLAGS.user_chars)})
            requests.append(list(chat))
            chat.append({"role": "assistant", "content": REPLY})
        turns.append(requests)
    return turns


def http_json(url: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + FLAGS.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).read()
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} in {FLAGS.start_timeout} s")


@dataclass
class Server:
    """One ``jaxkv-server`` process on loopback ports, publishing KV events with replay."""

    memory: str
    raw_events: bool = False
    host_tier: str | None = None
    """``--kv_offloading_size`` (None: no host tier)."""
    host_file: str | None = None
    """``--kv_offloading_path``: kept across a restart."""
    peers: str | None = None
    """``--kv_offloading_peers``: the other replicas' files it reads."""
    port: int = field(default_factory=free_port)
    events: str = field(default_factory=lambda: f"tcp://{HOST}:{free_port()}")
    replay: str = field(default_factory=lambda: f"tcp://{HOST}:{free_port()}")
    proc: subprocess.Popen | None = None
    hits: float = 0.0
    queries: float = 0.0
    """Counters of processes already stopped (a restart starts them from 0)."""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "jaxkv.server", "--checkpoint", FLAGS.checkpoint, "--port", str(self.port)]
        cmd += ["--memory", self.memory, "--kv_events_endpoint", self.events]
        cmd += ["--kv_events_replay_endpoint", self.replay, "--kv_events_plaintext_tcp"]
        if self.raw_events:
            cmd.append("--kv_events_raw")
        if self.host_tier is not None:
            cmd += ["--kv_offloading_size", self.host_tier]
        if self.host_file is not None:
            cmd += ["--kv_offloading_path", self.host_file]
        if self.peers is not None:
            cmd += ["--kv_offloading_peers", self.peers]
        if self.host_file is not None and FLAGS.kv_offloading_store is not None:
            cmd += ["--kv_offloading_store", FLAGS.kv_offloading_store]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self) -> None:
        assert self.proc is not None
        wait_http(self.url + "/health", self.proc, f"jaxkv-server on {self.port}")

    def counters(self) -> tuple[float, float]:
        """Hits (device and host tier) and queries (tokens) of every process so far."""
        hits, queries = self.hits, self.queries
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")):
                    hits += float(line.split()[-1])  # the device's hits and the host tier's
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.split()[-1])
        return hits, queries

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Kill it (SIGKILL: its cache is lost) and start it again on the same ports."""
        self.hits, self.queries = self.counters()
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.start()
        self.wait()


@contextlib.contextmanager
def servers(
    n: int,
    memory: str,
    raw_events: bool = False,
    host_tier: str | None = None,
    in_files: bool = False,
    shared: bool = False,
) -> Iterator[list[Server]]:
    """``n`` servers of ``memory`` each, with a host tier of ``host_tier`` bytes each (None: none),
    each kept in a file of its own (``in_files``) that outlives a restart, read by the others
    (``shared``)."""
    files = tempfile.TemporaryDirectory()
    peers = f"{files.name}/*.kv" if shared else None
    fleet = [
        Server(memory, raw_events, host_tier, f"{files.name}/replica{i}.kv" if in_files else None, peers)
        for i in range(n)
    ]
    try:
        for s in fleet:
            s.start()
        for s in fleet:
            s.wait()
        yield fleet
    finally:
        for s in fleet:
            s.stop()
        files.cleanup()


def router_command(kind: str, policy: str, fleet: list[Server], port: int, model: str) -> list[str]:
    bin_dir = Path(FLAGS.routers_venv) / "bin"
    urls = [s.url for s in fleet]
    if kind == "vllm":
        cmd = [str(bin_dir / "vllm-router"), "--host", HOST, "--port", str(port), "--policy", policy]
        cmd += ["--prometheus-host", HOST, "--prometheus-port", str(free_port()), "--worker-urls", *urls]
        if policy == "kv_aware":
            for s in fleet:
                cmd += ["--kv-event-source", f"{s.url}={s.events}", "--kv-event-replay-source", f"{s.url}={s.replay}"]
            block_size = http_json(fleet[0].url + "/server_info")["block_size"]
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        if FLAGS.router_logs or policy == "kv_aware":  # kv_aware's decisions are read from its debug log
            cmd += ["--log-level", "debug"]
        return cmd
    cmd = [str(bin_dir / "python"), "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port)]
    cmd += ["--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    return [*cmd, "--worker-urls", *urls]


def router_missing(kind: str) -> str | None:
    """Why the router cannot run here (None: it can)."""
    bin_dir = Path(FLAGS.routers_venv) / "bin"
    if kind == "vllm":
        return None if (bin_dir / "vllm-router").exists() else f"no vllm-router in {bin_dir}"
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import sglang_router"], capture_output=True, check=False)
    return None if probe.returncode == 0 else f"no sglang_router in {FLAGS.routers_venv}"


def chat(url: str, model: str, messages: list[dict[str, str]]) -> int:
    """Send one chat request; the prompt tokens the serving replica found cached."""
    body = {"model": model, "messages": messages, "max_tokens": FLAGS.max_tokens, "temperature": 0}
    answer = http_json(url + "/v1/chat/completions", body)
    if "choices" not in answer:
        raise RuntimeError(f"{url}: {answer}")
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


ANSI = re.compile(r"\x1b\[[0-9;]*m")
CREDITED = re.compile(r"KV prefix decision .*credited_prefix_tokens=(\d+)")


def credited_tokens(log: Path) -> list[int]:
    """vllm-router ``kv_aware``'s credited prefix tokens, decision by decision, from its debug log."""
    return [
        int(m[1]) for line in log.read_text(errors="replace").splitlines() if (m := CREDITED.search(ANSI.sub("", line)))
    ]


def credit_row(credited: list[int], cached: list[int]) -> dict:
    """Tokens the router credited and those the replicas then recomputed (None where the
    log's decisions do not pair one to one with the requests)."""
    row = {"credited_tokens": sum(credited), "credited": credited, "cached": cached}
    paired = len(credited) == len(cached)
    row["recomputed_credited_tokens"] = (
        sum(max(0, c - hit) for c, hit in zip(credited, cached, strict=True)) if paired else None
    )
    return row


def hit_rate(fleet: list[Server], before: tuple[float, float]) -> tuple[float, float, float]:
    hits = sum(s.counters()[0] for s in fleet) - before[0]
    queries = sum(s.counters()[1] for s in fleet) - before[1]
    return hits, queries, hits / queries if queries else 0.0


def run_fleet(
    kind: str, policy: str, turns: list, model: str, raw_events: bool = False, host_tier: str = "none"
) -> dict:
    with (
        servers(
            FLAGS.num_replicas,
            FLAGS.memory,
            raw_events,
            None if host_tier == "none" else str(parse_bytes(FLAGS.kv_offloading_size)),
            in_files=host_tier in ("file", "shared"),
            shared=host_tier == "shared",
        ) as fleet,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for i, messages in enumerate(turns[0]):  # the replicas cache before the router starts
            chat(fleet[i % len(fleet)].url, model, messages)
        before = tuple(sum(c) for c in zip(*(s.counters() for s in fleet), strict=True))
        port = free_port()
        cmd = router_command(kind, policy, fleet, port, model)
        name = f"{kind}-{policy}{'-raw' if raw_events else ''}-{host_tier}.log"
        log = Path(FLAGS.router_logs or tmp) / name
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://{HOST}:{port}/v1/models", router, f"{kind}-router")
            time.sleep(FLAGS.router_settle_s)  # the replicas' idle batches (1 s) reach it: it replays
            cached = [chat(f"http://{HOST}:{port}", model, messages) for messages in turns[1]]
            late_join = hit_rate(fleet, before)
            fleet[-1].restart()
            for later in turns[2:]:
                cached += [chat(f"http://{HOST}:{port}", model, messages) for messages in later]
            total = hit_rate(fleet, before)
        finally:
            router.terminate()
            router.wait(10)
        row = {"late_join_hit_rate": late_join[2], "hits": total[0], "queries": total[1], "hit_rate": total[2]}
        if policy == "kv_aware":
            row.update(credit_row(credited_tokens(log), cached))
    return row


def run_big(turns: list, model: str, host_tier: str) -> dict:
    """One server with the replicas' memory (and host tiers, in memory: it is never restarted) together."""
    big = str(parse_bytes(FLAGS.memory) * FLAGS.num_replicas)
    host = None if host_tier == "none" else str(parse_bytes(FLAGS.kv_offloading_size) * FLAGS.num_replicas)
    with servers(1, big, host_tier=host) as (server,):
        for messages in turns[0]:
            chat(server.url, model, messages)
        before = server.counters()
        for messages in turns[1]:
            chat(server.url, model, messages)
        late_join = hit_rate([server], before)
        for later in turns[2:]:
            for messages in later:
                chat(server.url, model, messages)
        total = hit_rate([server], before)
    return {
        "memory": big,
        "host_tier": server.host_tier,
        "late_join_hit_rate": late_join[2],
        "hits": total[0],
        "queries": total[1],
        "hit_rate": total[2],
    }


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.checkpoint is None or not (Path(FLAGS.checkpoint) / "tokenizer.json").exists():
        exit_error(PROG, f"--checkpoint={FLAGS.checkpoint} must be a checkpoint directory with a tokenizer.json")
    turns = trace()
    model = Path(FLAGS.checkpoint).name
    started = time.monotonic()
    bad = [t for t in FLAGS.host_tiers if t not in HOST_TIERS]
    if bad or not FLAGS.host_tiers:
        exit_error(PROG, f"--host_tiers: some of {', '.join(HOST_TIERS)}, got {FLAGS.host_tiers}")
    results: dict = {"configs": {}}
    for host_tier in FLAGS.host_tiers:
        big = "big" if host_tier == "none" else "big+host"
        if big not in results:
            results[big] = run_big(turns, model, host_tier)
        run_configs(results, turns, model, host_tier, results[big]["hit_rate"])
    results["wall_s"] = time.monotonic() - started
    results["settings"] = {
        name: FLAGS[name].value
        for name in (
            "num_replicas",
            "memory",
            "kv_offloading_size",
            "num_tenants",
            "system_chars",
            "num_conversations",
            "turns",
            "user_chars",
            "max_tokens",
            "kv_events",
            "kv_offloading_store",
        )
    }
    print_table(results)
    if FLAGS.out:
        Path(FLAGS.out).write_text(json.dumps(results, indent=2) + "\n")


def run_configs(results: dict, turns: list, model: str, host_tier: str, big_rate: float) -> None:
    """Every ``--configs`` entry (``kv_aware`` once per ``--kv_events`` stream) with ``host_tier``."""
    suffix = "" if host_tier == "none" else f" +host {host_tier}"
    for config in FLAGS.configs:
        kind, _, policy = config.partition(":")
        if kind not in ("vllm", "sglang") or not policy:
            exit_error(PROG, f"--configs: ROUTER:POLICY with ROUTER vllm or sglang, got {config!r}")
        missing = router_missing(kind)
        if missing is not None:
            results["configs"][config + suffix] = {"skipped": missing}
            continue
        for events in FLAGS.kv_events if policy == "kv_aware" else ["state_aware"]:
            if events not in ("state_aware", "raw"):
                exit_error(PROG, f"--kv_events: state_aware or raw, got {events!r}")
            row = run_fleet(kind, policy, turns, model, raw_events=events == "raw", host_tier=host_tier)
            row["ratio"] = row["hit_rate"] / big_rate if big_rate else 0.0
            row["host_tier"] = host_tier
            results["configs"][config + ("[raw]" if events == "raw" else "") + suffix] = row


def print_table(results: dict) -> None:
    print(
        f"{'router:policy':<{WIDTH}} {'late join':>10} {'hit rate':>9} {'vs big':>7}"
        f" {'hit tokens':>10} {'credited':>9} {'recomputed':>10}"
    )
    for key, name in (("big", "one big cache"), ("big+host", "one big cache +host")):
        big = results.get(key)
        if big is None:
            continue
        line = f"{name:<{WIDTH}} {big['late_join_hit_rate']:>10.3f} {big['hit_rate']:>9.3f} {1.0:>7.3f}"
        print(f"{line} {big['hits']:>10.0f}")
    for config, row in results["configs"].items():
        if "skipped" in row:
            print(f"{config:<{WIDTH}} skipped: {row['skipped']}")
            continue
        line = f"{config:<{WIDTH}} {row['late_join_hit_rate']:>10.3f} {row['hit_rate']:>9.3f} {row['ratio']:>7.3f}"
        line += f" {row['hits']:>10.0f}"
        if "credited_tokens" in row:
            recomputed = row["recomputed_credited_tokens"]
            share = (
                f"{recomputed / row['credited_tokens']:.1%}"
                if recomputed is not None and row["credited_tokens"]
                else "n/a"
            )
            line += f" {row['credited_tokens']:>9} {share:>10}"
        print(line)
    print(
        f"({results['wall_s']:.0f} s; late join: the routed turn before the restart; hit rate: every routed turn;"
        " recomputed: the share of credited tokens the replica recomputed)"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
