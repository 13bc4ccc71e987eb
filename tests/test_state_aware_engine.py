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
from jaxkv.serving.kv_events import KVEventPublisher, external_hash  # noqa: E402
from jaxkv.serving.state_aware_events import StateAwareEvents  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
BLOCK = 16


def credited_blocks(pub: KVEventPublisher, eng: Engine, prompt: list[int]) -> int:
    """What a router started now would credit ``prompt`` with: a fresh index, replayed
    from batch 0 (the late-join case), matched block by block from the prompt's start."""
    index = PrefixIndex()
    assert pub.replay_endpoint is not None
    with KVEventSubscriber(index, "r", pub.endpoint, replay_endpoint=pub.replay_endpoint, plaintext_tcp=True) as sub:
        sub.catch_up()
    (attention, *_) = StateAwareEvents.for_config(eng.manager.config).attention_groups
    hashes = eng.manager.hashes_per_group(Request("probe", prompt))[attention]
    return index.longest_prefix([external_hash(x) for x in hashes]).get("r", 0)


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
                blocks = credited_blocks(pub, eng, prompt)
                (out,) = eng.generate([prompt], 6).outputs
                replies.append(out)
                credited += blocks * BLOCK
                recomputed += max(0, blocks * BLOCK - out.num_cached_tokens)
    if state_aware:
        assert credited > 0 and recomputed == 0, (credited, recomputed)
    else:
        assert recomputed > 0, (credited, recomputed)
