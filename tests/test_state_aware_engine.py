"""State-aware KV events from a hybrid engine (tiny Qwen3-Next): every block a late
subscriber's prefix index credits a prompt with is a real hit when the prompt is sent."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from jaxkv.core.manager import Request  # noqa: E402
from jaxkv.device.metadata import Buckets  # noqa: E402
from jaxkv.fleet.prefix_index import KVEventSubscriber, PrefixIndex  # noqa: E402
from jaxkv.serving.engine import Engine  # noqa: E402
from jaxkv.serving.kv_events import MEDIUM_DEVICE, MEDIUM_HOST, KVEventPublisher, external_hash  # noqa: E402
from jaxkv.serving.offload_connector import OffloadConfig  # noqa: E402
from jaxkv.serving.state_aware_events import StateAwareEvents  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
BLOCK = 16


class Probe(NamedTuple):
    credited: dict[str | None, int]
    """Tokens a late router credits the prompt with, per medium (None: any)."""
    hit: int
    """Tokens the engine then hit."""


def late_index(pub: KVEventPublisher) -> PrefixIndex:
    """What a router started now knows: a fresh index, replayed from batch 0 (the late-join case)."""
    index = PrefixIndex()
    assert pub.replay_endpoint is not None
    with KVEventSubscriber(index, "r", pub.endpoint, replay_endpoint=pub.replay_endpoint, plaintext_tcp=True) as sub:
        sub.catch_up()
    return index


def credited_blocks(index: PrefixIndex, eng: Engine, prompt: list[int], medium: str | None = None) -> int:
    """The blocks ``index`` credits ``prompt`` with (on ``medium``, or any), matched block by block from its start."""
    (attention, *_) = StateAwareEvents.for_config(eng.manager.config).attention_groups
    hashes = eng.manager.hashes_per_group(Request("probe", prompt))[attention]
    return index.longest_prefix([external_hash(x) for x in hashes], medium).get("r", 0)


def chats(
    pub: KVEventPublisher,
    seed: int,
    memory_bytes: int,
    offload: OffloadConfig | None = None,
    num_chats: int = 5,
    turns: int = 2,
) -> list[Probe]:
    """Five chats (or the first ``num_chats``) over one 40-token system prompt on tiny
    Qwen3-Next: turn 1 together, then ``turns`` more (the prompt, the reply, a new
    message) chat by chat, each credited by a router that joins just before it. Per
    prompt after turn 1: the tokens credited per medium (None: any) and the tokens the
    engine hit."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 512, 40).tolist()
    prompts = [system + rng.integers(0, 512, n).tolist() for n in (21, 37, 50, 29, 44)[:num_chats]]
    eng = Engine.build(
        "tiny-qwen3-next",
        memory_bytes=memory_bytes,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        buckets=Buckets((64,), (4,), (16,)),
        offload=offload,
        kv_events=pub,
    )
    replies = eng.generate(prompts, 6).outputs
    probes = []
    for _ in range(turns):
        prompts = [
            p + list(o.output_token_ids) + rng.integers(0, 512, 9).tolist()
            for p, o in zip(prompts, replies, strict=True)
        ]
        replies = []
        for prompt in prompts:
            index = late_index(pub)
            credited = {m: credited_blocks(index, eng, prompt, m) * BLOCK for m in (MEDIUM_DEVICE, MEDIUM_HOST, None)}
            (out,) = eng.generate([prompt], 6).outputs
            replies.append(out)
            probes.append(Probe(credited, out.num_cached_tokens))
    return probes


@pytest.mark.slow
@pytest.mark.parametrize("state_aware", [True, False])
def test_every_credited_block_is_a_real_hit_only_with_state_aware_events(state_aware):
    """Five chats (:func:`chats`) on a 2 MiB cache. With state-aware events the tokens
    credited and then recomputed are 0 and some are credited; with the raw per-group
    events a router credits attention blocks the engine recomputes."""
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, state_aware=state_aware) as pub:
        probes = chats(pub, 0, 2 << 20)
    credited = sum(p.credited[None] for p in probes)
    recomputed = sum(max(0, p.credited[None] - p.hit) for p in probes)
    if state_aware:
        assert credited > 0 and recomputed == 0, (credited, recomputed)
    else:
        assert recomputed > 0, (credited, recomputed)


def recomputed(probes: list[Probe]) -> list[Probe]:
    """The prompts credited, on some medium, tokens the engine then recomputed."""
    return [p for p in probes if max(p.credited.values()) > p.hit]


@pytest.mark.slow
def test_a_chat_whose_own_checkpoint_was_evicted_is_not_credited_the_shared_system_prompt():
    """Four chats (:func:`chats`, turn 2 only) on a 1 MiB device: its state pool holds few
    checkpoints, so a chat's own checkpoint goes while its attention blocks stay, and its
    next turn follows that branch, which reaches no checkpoint, off the system prompt's
    last block (no checkpoint there), published by another chat's deeper checkpoint. The
    system prompt must not be credited then: before the dead-branch rule it was, 32 tokens
    to three prompts that resumed at 0 (two following their own dead branch, one whose
    branch was gone). Every credited token is hit, and some are (the engine checkpoints
    the system prompt's end once a prompt leaves there)."""
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        probes = chats(pub, 1, 1 << 20, num_chats=4, turns=1)
    assert not recomputed(probes), probes
    assert sum(p.credited[None] for p in probes) > 0, probes


@pytest.mark.slow
def test_host_tier_events_credit_only_real_hits_where_chats_branch():
    """Five chats (:func:`chats`) on a 1 MiB device with a 2 MiB host tier (whose state
    tier holds 2 checkpoints). The system prompt's last block is where the chats branch;
    its own checkpoint leaves the host while other chats' deeper ones stay, so a chat
    whose own chain is gone leaves the announced tree there: the host tier's (``"CPU"``)
    events must not credit it past where it resumes (they did, 32 tokens, before branch
    points needed their own checkpoint). Nor may the device's (``"GPU"``), whose chains the
    host tier's include: a chat whose chain had left the device was credited 32 tokens
    there in some runs (the asynchronous host stores' timing decides what the small pools
    keep) before the device stream took the same rule. Every credited token on each
    medium is hit; the host tier credits at least what the device does (more when its
    on-eviction stores have landed before the probe: they complete asynchronously, so a
    run under load may find them still in flight)."""
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        probes = chats(pub, 1, 1 << 20, OffloadConfig(2 << 20))
    assert not recomputed(probes), probes
    device, host = (sum(p.credited[m] for p in probes) for m in (MEDIUM_DEVICE, MEDIUM_HOST))
    assert host >= device > 0, (host, device)
