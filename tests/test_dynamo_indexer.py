"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` of ``ai-dynamo-runtime``)
fed by jaxkv engines' KV events scores a prompt's overlap per replica as jaxkv's own
:class:`~jaxkv.fleet.prefix_index.PrefixIndex` does, live or joining late (by replay), for an
attention-only model and for a hybrid's state-aware events. Runs where the venv that
``JAXKV_DYNAMO_VENV`` names has Dynamo (``pip install ai-dynamo-runtime==1.6.1``, no CUDA
needed); skips with the reason elsewhere."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from jaxkv.core.manager import Request
from jaxkv.fleet.prefix_index import KVEventSubscriber, PrefixIndex
from jaxkv.serving.engine import Engine
from jaxkv.serving.kv_events import KVEventPublisher, external_hash
from jaxkv.serving.state_aware_events import StateAwareEvents

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # engines and Dynamo's Rust indexer in a process
MODEL = "tiny-llama"


def dynamo_python() -> Path | None:
    named = os.environ.get("JAXKV_DYNAMO_VENV")
    python = None if not named else Path(named) / "bin" / "python"
    if python is None or not python.exists():
        return None
    found = subprocess.run([python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60)
    return python if found.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> object:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"null")


def prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Each replica's prompts (two system prompts shared across replicas, each with its own
    questions), and probes that share more or less of them."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 200, n).tolist() for n in (64, 48)]
    served = [[systems[0] + rng.integers(0, 200, 40).tolist()], [systems[1] + rng.integers(0, 200, 24).tolist()]]
    served[1].append(systems[0][:32] + rng.integers(0, 200, 40).tolist())
    probes = [served[0][0], served[1][0], systems[0] + rng.integers(0, 200, 30).tolist(), served[1][1][:50]]
    return served, [*probes, rng.integers(0, 200, 60).tolist()]


def dynamo_and_jaxkv_scores(
    tmp_path: Path, model: str, *, late: bool
) -> tuple[list[dict[int, int]], dict[tuple[int, int], int], int]:
    """Two engines of ``model`` serve :func:`prompts`; Dynamo's indexer and jaxkv's
    ``PrefixIndex`` score every probe per replica (matched tokens), waiting up to 30 s for
    them to agree; then each probe is sent to each replica credited with it. ``late``: both
    start after the engines cached and catch up by replay (Dynamo from the replay endpoint
    given at registration). The scores, the hit tokens per (probe, replica) and the block size."""
    python = dynamo_python()
    if python is None:
        pytest.skip("Dynamo's indexer is not installed (set JAXKV_DYNAMO_VENV to a venv with ai-dynamo-runtime)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "indexer.log").open("w")
    publishers = [  # an empty batch when idle: a late subscriber sees where the stream is and replays
        KVEventPublisher("tcp://127.0.0.1:*", plaintext_tcp=True, replay_endpoint="tcp://127.0.0.1:*", idle_batch_s=0.5)
        for _ in range(2)
    ]
    index = PrefixIndex()
    subscribers: list[KVEventSubscriber] = []
    indexer = None
    try:
        engines = [
            Engine.build(model, memory_bytes=4 << 20, max_model_len=256, max_num_seqs=4, kv_events=p)
            for p in publishers
        ]
        config = engines[0].manager.config
        block_size = config.hash_block_size
        transform = StateAwareEvents.for_config(config)
        group = 0 if transform is None else transform.attention_groups[0]  # the chain the events carry
        served, probes = prompts()

        def serve() -> None:
            for engine, batch in zip(engines, served, strict=True):
                engine.generate(batch, 4)

        if late:
            serve()
        indexer = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"], stdout=log, stderr=log
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/workers", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline and indexer.poll() is None, "Dynamo's indexer did not start"
                time.sleep(0.2)
        for replica, publisher in enumerate(publishers):
            endpoint = {"instance_id": replica, "endpoint": publisher.endpoint, "model_name": model}
            replay = {"replay_endpoint": publisher.replay_endpoint} if late else {}
            post(f"{url}/register", {**endpoint, **replay, "block_size": block_size})
            subscribers.append(
                KVEventSubscriber(
                    index, replica, publisher.endpoint, replay_endpoint=publisher.replay_endpoint, plaintext_tcp=True
                )
            )
        if late:
            for subscriber in subscribers:
                subscriber.catch_up()
        else:
            time.sleep(1.0)  # both subscribers joined before the first batch (ZeroMQ's slow joiner)
            serve()
        hashes = [
            [external_hash(h) for h in engines[0].manager.hashes_per_group(Request("p", q))[group]] for q in probes
        ]

        def scores() -> tuple[list[dict[int, int]], list[dict[int, int]]]:  # matched tokens per replica
            for subscriber in subscribers:
                subscriber.poll(0.1)
            ours = [{r: n * block_size for r, n in index.longest_prefix(h).items() if n} for h in hashes]
            theirs = [dynamo_scores(post(f"{url}/query", {"token_ids": q, "model_name": model})) for q in probes]
            return ours, theirs

        deadline = time.monotonic() + 30
        ours, theirs = scores()
        while ours != theirs and time.monotonic() < deadline:
            time.sleep(0.5)
            ours, theirs = scores()
        hits = {
            (i, replica): engines[replica].generate([probes[i]], 1).outputs[0].num_cached_tokens
            for i, credited in enumerate(ours if ours == theirs else [])
            for replica in credited
        }
    finally:
        for subscriber in subscribers:
            subscriber.close()
        for publisher in publishers:
            publisher.close()
        if indexer is not None:
            indexer.terminate()
            indexer.wait(30)
        log.close()
    assert ours == theirs, (tmp_path / "indexer.log").read_text()[-3000:]
    return ours, hits, block_size


def recomputed(ours: list[dict[int, int]], hits: dict[tuple[int, int], int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(probe, replica) -> (credited, hit) where the replica hit less than it was credited."""
    return {key: (ours[key[0]][key[1]], hit) for key, hit in hits.items() if hit < ours[key[0]][key[1]]}


@pytest.mark.parametrize("late", [False, True], ids=["live", "late_join"])
def test_dynamos_indexer_scores_each_replica_as_jaxkvs_prefix_index_does(tmp_path, late):
    ours, hits, block_size = dynamo_and_jaxkv_scores(tmp_path, MODEL, late=late)
    assert not recomputed(ours, hits), "an attention-only model hits all it is credited"
    assert ours[0] == {0: 104 // block_size * block_size, 1: 32} and ours[-1] == {}, "its own prompt; nobody's"
    assert len({n for score in ours for n in score.values()}) >= 3, "the probes overlap by different lengths"


def test_dynamos_indexer_follows_a_hybrids_state_aware_events_joining_late(tmp_path):
    """tiny Qwen3-Next: Dynamo reads the state-aware chain (no group) as a single-group
    model and credits exactly what jaxkv's index does. A prompt a replica served resumes
    where it is credited; a probe that leaves a replica's chain before the checkpoint at
    its end is credited the shared blocks and recomputes them (the known limit of a
    prefix-matching router: it cannot tell where the engine resumes inside a chain)."""
    ours, hits, _ = dynamo_and_jaxkv_scores(tmp_path, "tiny-qwen3-next", late=True)
    assert ours[-1] == {} and any(ours), "nobody's prompt; some credited"
    assert hits[0, 0] >= ours[0][0] > 0 and hits[1, 1] >= ours[1][1] > 0, "served prompts resume where credited"
    assert (0, 1) in recomputed(ours, hits), "probe 0 leaves replica 1's chain between its checkpoints"


def dynamo_scores(answer: object) -> dict[int, int]:
    """Dynamo's ``/query`` answer (``scores``: instance -> data-parallel rank -> matched tokens)
    as {instance id: matched tokens}."""
    assert isinstance(answer, dict) and isinstance(answer.get("scores"), dict), answer
    return {int(replica): sum(ranks.values()) for replica, ranks in answer["scores"].items() if sum(ranks.values())}
