"""``jaxkv-server`` started as a user starts it: bare, then with flags it must refuse before binding, then
with a host tier kept in a file across a SIGKILL (the restarted server announces the reloaded blocks in
its KV events, a late replay included, and serves the prompt from them)."""

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from hf_checkpoints import save_tiny_checkpoint
from script_runs import repo_env
from tiny_tokenizer import save_tiny_tokenizer

pytest.importorskip("uvicorn")

from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import InsufficientMemoryError, PlanError
from jaxkv.server.cli import largest_max_model_len, parser, plan_or_refuse
from jaxkv.serving.engine import plan_for_model

SERVER = [sys.executable, "-m", "jaxkv.server"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The stored tiny Llama (512 positions) with a tokenizer, as the README's third command saves it."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_bound(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_bare_start_serves_the_checkpoint_positions_and_says_it_is_ready(checkpoint):
    port = free_port()
    server = subprocess.Popen(
        [*SERVER, "--checkpoint", str(checkpoint), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=repo_env(),
    )
    try:
        ready = server.stdout.readline()  # the engine is built before the port is bound
        assert ready.startswith(f"jaxkv-server: ready on http://127.0.0.1:{port}: model {checkpoint.name}"), (
            ready + server.stderr.read()
        )
        assert "max_model_len 512" in ready
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as answer:
            card = json.load(answer)["data"][0]
        assert card["id"] == checkpoint.name and card["max_model_len"] == 512
    finally:
        server.terminate()
        server.wait(60)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--memory", "200KiB"], "in --memory 204,800 B --max_model_len 240 fits"),
        (["--max_model_len", "4096"], "exceeds the 512 positions of config.json"),
        (["--api_key", ""], "--api_key is empty"),
        (["--header_timeout_s", "nan"], "--header_timeout_s=nan is out of range"),
    ],
)
def test_what_cannot_be_served_exits_2_in_one_line_before_binding(checkpoint, flags, says):
    port = free_port()
    run = subprocess.run(
        [*SERVER, "--checkpoint", str(checkpoint), "--port", str(port), *flags],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and says in run.stderr
    assert not run.stdout and not is_bound(port)


def test_help_names_each_default():
    text = " ".join(parser().format_help().split())
    for shown in (
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "(default: 256MiB)",
        "(default: 1MiB)",
        "(default: 16)",
        "(default: 10.0)",
    ):
        assert shown in text
    assert "(default: the checkpoint's positions)" in text and "(default: None)" not in text


@pytest.mark.parametrize("memory", [150_000, 405_504, 1 << 20])
def test_the_largest_fitting_length_fits_and_one_more_token_does_not(memory):
    model = TinyLM(get_model_config("tiny-llama"), seed=0, name="tiny-llama")
    fits = largest_max_model_len(model, memory, 100_000)
    plan_for_model(model, memory, max_model_len=fits)
    with pytest.raises(PlanError):
        plan_for_model(model, memory, max_model_len=fits + 1)
    with pytest.raises(InsufficientMemoryError, match=f"--max_model_len {fits} fits"):
        plan_or_refuse(model, memory, fits + 1)
    assert plan_or_refuse(model, memory, fits).max_model_len == fits


@pytest.mark.slow
@pytest.mark.subprocess
def test_kv_events_flags_publish_stored_blocks_with_their_token_ids(checkpoint, tmp_path):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from jaxkv.server.cli import ServerThread, build_app, event_publisher

    flags = ["--checkpoint", str(checkpoint), "--memory", "4MiB", "--max_model_len", "256"]
    args = parser().parse_args([*flags, "--kv_events_endpoint", f"ipc://{tmp_path}/events", "--kv_events_topic", "kv"])
    publisher = event_publisher(args)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.setsockopt(zmq.RCVTIMEO, 60_000)
    subscriber.connect(publisher.endpoint)
    server = ServerThread(build_app(args, publisher))
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        body = json.dumps({"model": checkpoint.name, "prompt": list(range(40)), "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=120).read()
        topic, _, payload = subscriber.recv_multipart()
        _, events, _ = msgspec.msgpack.decode(payload)
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert topic == b"kv" and stored and stored[0]["token_ids"] == list(range(32)), "the prompt's 2 full blocks"
    finally:
        server.close()
        subscriber.close()
        publisher.close()


def test_a_replay_endpoint_without_an_endpoint_is_refused(capsys):
    from jaxkv.server.cli import event_publisher

    with pytest.raises(SystemExit) as exit_:
        event_publisher(parser().parse_args(["--checkpoint", "x", "--kv_events_replay_endpoint", "ipc:///tmp/r"]))
    assert exit_.value.code == 2 and "needs --kv_events_endpoint" in capsys.readouterr().err


# ------------------------------------------------------------------ the host tier, kept in a file
def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return answer.read()


def answer(url: str, model: str, prompt: list[int], max_tokens: int = 1) -> dict:
    """The completion's JSON body."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def complete(url: str, model: str, prompt: list[int]) -> int:
    """The prompt tokens served from cache (device or host)."""
    return answer(url, model, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]


def replayed_cpu_blocks(endpoint: str) -> int:
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        count = 0
        while True:
            assert sock.poll(30_000), "no replay answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return count
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored" and event["medium"] == "CPU":
                    count += len(event["block_hashes"])
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_server_killed_and_restarted_on_its_file_announces_and_serves_the_reloaded_blocks(checkpoint, tmp_path):
    port, events, replay = free_port(), f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    cmd = [*SERVER, "--checkpoint", str(checkpoint), "--port", str(port), "--memory", "4MiB"]
    cmd += ["--max_model_len", "256", "--kv_offloading_size", "1MiB", "--kv_offloading_path", str(tmp_path / "host")]
    cmd += ["--kv_events_endpoint", events, "--kv_events_replay_endpoint", replay]
    url, prompt = f"http://127.0.0.1:{port}", list(range(1, 101))

    def start() -> tuple[subprocess.Popen, str]:
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=repo_env())
        ready = server.stdout.readline()
        assert ready.startswith("jaxkv-server: ready"), ready + server.stderr.read()
        return server, ready

    server, ready = start()
    try:
        assert ", host tier 85 blocks (1,044,480 B, kept in" in ready and "0 reloaded" in ready, ready
        info = json.loads(get(f"{url}/server_info"))
        assert info["num_cpu_blocks"] == 85 and info["kv_offloading_path"] == str(tmp_path / "host")
        assert complete(url, checkpoint.name, prompt) == 0
        metrics = get(f"{url}/metrics").decode()
        assert f'jaxkv:kv_offload_blocks{{kind="capacity",model_name="{checkpoint.name}"}} 85.0' in metrics
        assert 'kind="held"' in metrics
        server.send_signal(signal.SIGKILL)
        server.wait(60)
        server, ready = start()
        assert "6 reloaded" in ready, ready  # the prompt's 6 full blocks, written through
        assert replayed_cpu_blocks(replay) == 6  # announced before any request, in the replay too
        assert complete(url, checkpoint.name, prompt) == 96
        assert "vllm:external_prefix_cache_hits_total" in get(f"{url}/metrics").decode()
    finally:
        server.terminate()
        server.wait(60)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_replica_serves_from_the_host_tier_file_of_a_peer_on_the_machine(checkpoint, tmp_path):
    ports = free_port(), free_port()
    servers = []
    for i, port in enumerate(ports):
        cmd = [*SERVER, "--checkpoint", str(checkpoint), "--port", str(port), "--memory", "4MiB"]
        cmd += ["--max_model_len", "256", "--kv_offloading_size", "1MiB"]
        cmd += ["--kv_offloading_path", str(tmp_path / f"r{i}.kv"), "--kv_offloading_peers", str(tmp_path / "*.kv")]
        servers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=repo_env()))
    try:
        for server in servers:
            ready = server.stdout.readline()
            assert ready.startswith("jaxkv-server: ready") and ", peers " in ready, ready + server.stderr.read()
        (a, b), prompt = [f"http://127.0.0.1:{p}" for p in ports], list(range(1, 101))
        first = answer(a, checkpoint.name, prompt, max_tokens=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = answer(b, checkpoint.name, prompt, max_tokens=4)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # copied from r0.kv
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert json.loads(get(f"{b}/server_info"))["kv_offloading_peers"] == [str((tmp_path / "r0.kv").resolve())]
    finally:
        for server in servers:
            server.terminate()
            server.wait(60)
