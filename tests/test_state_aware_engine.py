"""State-aware KV events from a hybrid engine (tiny Qwen3-Next): every block a late
subscriber's prefix index credits a prompt with is a real hit when the prompt is sent."""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.parametrize("state_aware", [True, False])
def test_every_credited_block_is_a_real_hit_only_with_state_aware_events(state_aware):
    """Five chats over one shared system prompt on a small cache: turn 1 together, then
    turns 2 and 3 (the prompt, the reply, a new message) chat by chat, each credited by a
    router that joins just before it. With
    state-aware events the tokens credited and then recomputed are 0 and some are credited;
    with the raw per-group events a router credits attention blocks the engine recomputes."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 512, 40).tolist()
    firsts = [system + rng.integers(0, 512, n).tolist() for n in (21, 37, 50, 29, 44)]
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK, state_aware=state_aware) as pub:
        eng = Engine.build(
            "tiny-qwen3-next",
            memory_bytes=2 << 20,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            buckets=Buckets((64,), (4,), (16,)),
            kv_events=pub,
        )
        prompts = firsts
        replies = eng.generate(prompts, 6).outputs
        credited = recomputed = 0
        for _ in range(2):  # turns 2 and 3, chat by chat
            prompts = [
                p + list(o.output_token_ids) + rng.integers(0, 512, 9).tolist()
                for p, o in zip(prompts, replies, strict=True)
            ]
            replies = []
            for prompt in prompts:
                blocks = credited_blocks(late_index(pub), eng, prompt)
                (out,) = eng.generate([prompt], 6).outputs
                replies.append(out)
                credited += blocks * BLOCK
                recomputed += max(0, blocks * BLOCK - out.num_cached_tokens)
    if state_aware:
        assert credited > 0 and recomputed == 0, (credited, recomputed)
    else:
        assert recomputed > 0, (credited, recomputed)


@pytest.mark.slow
def test_host_tier_events_credit_only_real_hits_where_chats_branch():
    """Five chats over one system prompt on a 1 MiB device with a 2 MiB host tier (whose
    state tier holds 2 checkpoints): turn 1 together, then turns 2 and 3 chat by chat,
    each credited by a router that joins just before it. The system prompt's last block
    is where the chats branch; its own checkpoint leaves the host while other chats'
    deeper ones stay, so a chat whose own chain is gone leaves the announced tree there:
    the host tier's (``"CPU"``) events must not credit it past where it resumes (they
    did, 32 tokens, before branch points needed their own checkpoint). Every token
    credited on either medium is hit, and the host tier credits more than the device."""
    rng = np.random.default_rng(1)
    system = rng.integers(0, 512, 40).tolist()
    prompts = [system + rng.integers(0, 512, n).tolist() for n in (21, 37, 50, 29, 44)]
    with KVEventPublisher(LOOPBACK, plaintext_tcp=True, replay_endpoint=LOOPBACK) as pub:
        eng = Engine.build(
            "tiny-qwen3-next",
            memory_bytes=1 << 20,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            buckets=Buckets((64,), (4,), (16,)),
            offload=OffloadConfig(2 << 20),
            kv_events=pub,
        )
        replies = eng.generate(prompts, 6).outputs
        credited = {MEDIUM_DEVICE: 0, MEDIUM_HOST: 0}
        over: list[tuple[str, int, int]] = []
        for _ in range(2):
            prompts = [
                p + list(o.output_token_ids) + rng.integers(0, 512, 9).tolist()
                for p, o in zip(prompts, replies, strict=True)
            ]
            replies = []
            for prompt in prompts:
                index = late_index(pub)
                blocks = {m: credited_blocks(index, eng, prompt, m) for m in (*credited, None)}
                (out,) = eng.generate([prompt], 6).outputs
                replies.append(out)
                for medium, n in blocks.items():
                    credited[medium or "any"] = credited.get(medium or "any", 0) + n * BLOCK
                    if n * BLOCK > out.num_cached_tokens:
                        over.append((medium or "any", n * BLOCK, out.num_cached_tokens))
    assert not over, over
    assert credited[MEDIUM_HOST] > credited[MEDIUM_DEVICE] > 0, credited
