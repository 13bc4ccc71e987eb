"""The router: its policies on fake loads and cached prefixes (pure), prompts hashed as
the replicas' engines hash them, and a replica that dies mid-trace (its requests
retried on another, its prefixes gone from the index, nothing sent to it again)."""

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from thread_replicas import ThreadReplica  # noqa: E402

from jaxkv.fleet.protocol import ReplicaAddress  # noqa: E402
from jaxkv.fleet.router import NoLiveReplicaError, Router, RouterError, pick_replica  # noqa: E402
from jaxkv.hashing import BlockHasher, ExtraKeys  # noqa: E402
from jaxkv.serving.kv_events import WireBlockStored, external_hash  # noqa: E402


# --- policies ------------------------------------------------------------------------
def test_prefix_routing_sends_a_prompt_to_its_longest_cached_prefix():
    loads = {"a": 1, "b": 1, "c": 1}
    assert pick_replica("prefix", loads, {"a": 32, "b": 160, "c": 96}, load_penalty=64, turn=0) == "b"


def test_a_busy_replica_loses_its_cached_prefix_to_an_idle_one_past_the_load_penalty():
    cached = {"a": 256}
    assert pick_replica("prefix", {"a": 3, "b": 0}, cached, load_penalty=64, turn=0) == "a"  # 256 - 192 > 0
    assert pick_replica("prefix", {"a": 5, "b": 0}, cached, load_penalty=64, turn=0) == "b"  # 256 - 320 < 0


def test_a_prompt_cached_nowhere_goes_to_the_least_loaded_and_ties_rotate():
    assert pick_replica("prefix", {"a": 2, "b": 1, "c": 2}, {}, load_penalty=64, turn=0) == "b"
    idle = {"a": 0, "b": 0, "c": 0}
    assert [pick_replica("prefix", idle, {}, load_penalty=64, turn=t) for t in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_ignores_loads_and_least_loaded_ignores_prefixes():
    loads, cached = {"a": 5, "b": 0, "c": 9}, {"c": 512}
    assert [pick_replica("round_robin", loads, cached, load_penalty=0, turn=t) for t in range(3)] == ["a", "b", "c"]
    assert pick_replica("least_loaded", loads, cached, load_penalty=0, turn=2) == "b"


def test_bad_policies_and_no_replica_are_refused():
    with pytest.raises(RouterError, match="policy must be one of .* got 'random'"):
        pick_replica("random", {"a": 0}, {}, load_penalty=0, turn=0)
    with pytest.raises(NoLiveReplicaError):
        pick_replica("prefix", {}, {}, load_penalty=0, turn=0)


# --- the router's view of the prefixes ------------------------------------------------
def addresses(tmp_path, *names):
    return {name: ReplicaAddress.ipc(tmp_path, name) for name in names}


def stored(prompt, *, salt=None, block_size=16):
    hashes = []
    BlockHasher(block_size).extend(hashes, prompt, ExtraKeys(cache_salt=salt))
    return WireBlockStored([external_hash(h) for h in hashes], None, [], block_size, None, "GPU", None)


def test_the_router_hashes_prompts_as_the_events_name_blocks(tmp_path):
    prompt = list(range(100))
    with Router(addresses(tmp_path, "a", "b")) as router:
        router.index.apply("a", [stored(prompt[:64])])
        router.index.apply("b", [stored(prompt[:32], salt="tenant")])
        assert router.cached_tokens(prompt + [7]) == {"a": 64, "b": 0}
        assert router.cached_tokens(prompt, cache_salt="tenant") == {"a": 0, "b": 32}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "fastest"}, "policy must be one of"),
        ({"load_penalty": -1}, "load_penalty must be a finite number >= 0, got -1"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s must be > 0"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_router_settings_are_refused(tmp_path, kwargs, match):
    with pytest.raises(Exception, match=match):
        Router(addresses(tmp_path, "a"), **kwargs)


# --- a replica dies mid-trace ---------------------------------------------------------
def test_a_dead_replicas_requests_are_retried_elsewhere_and_its_prefixes_leave_the_index(tmp_path):
    interval = 0.5
    replicas = [ThreadReplica(tmp_path, name, interval) for name in ("a", "b")]
    prompts = [[t % 512 for t in range(i, i + 80)] for i in range(6)]
    try:
        with Router({r.name: r.address for r in replicas}, policy="round_robin") as router:
            router.wait_ready(120)
            first = [router.submit(p, 2) for p in prompts[:2]]
            done = []
            while len(done) < 2:
                done += router.poll(0.05)
            assert {o.request_id for o in done} == set(first)
            while not router.cached_tokens(prompts[1])["b"]:  # b's KV events are in
                router.poll(0.05)
            ids = [router.submit(p, 24) for p in prompts[2:]]
            on_b = router.in_flight("b")
            assert on_b == 2
            replicas[1].kill()
            while router.num_in_flight:
                done += router.poll(0.05)
            sent_to_b = router.num_sent("b")
            assert router.live_replicas == ("a",) and "b" in router.dropped_replicas
            later = [o for o in done if o.request_id in ids]
            assert len(later) == 4 and all(o.error is None and len(o.output_token_ids) == 24 for o in later)
            retried = [o for o in later if o.attempts == 2]
            assert len(retried) == on_b and all(o.replica == "a" for o in retried)
            assert router.num_retries == on_b
            assert not any(r == "b" for where in router.index.snapshot().values() for r, _ in where)
            assert router.cached_tokens(prompts[1]) == {"a": 0}
            router.submit(prompts[1], 1)
            while router.num_in_flight:
                router.poll(0.05)
            assert router.num_sent("b") == sent_to_b
    finally:
        for replica in replicas:
            replica.kill()
