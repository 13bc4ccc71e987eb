"""Random request streams against the KVCacheManager's invariants, and against a
straightforward reference of vLLM v1's rules for one full-attention group."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_configs import FULL, window

from jaxkv.core.coordinator import RETENTION_RULES
from jaxkv.core.manager import KVCacheManager, KVCacheManagerError, Request
from jaxkv.planner import KVCacheConfig, KVCacheGroup, StatePool
from jaxkv.specs import ChunkedLocalAttentionSpec, MambaSpec

BS = 4
MAMBA = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
PREFIXES = [list(range(1000 * k, 1000 * k + 4 * BS + k)) for k in range(3)]
CONFIGS = {
    "full": (FULL,),
    "full+2 windows": (FULL, window(6), window(6)),
    "full+chunked": (FULL, ChunkedLocalAttentionSpec(num_kv_heads=1, head_size=1, attention_chunk_size=8)),
    "full+mamba": (FULL, MAMBA),
    "full+mamba state pool": (FULL, MAMBA),
    "full+2 mamba": (FULL, MAMBA, MAMBA),
    "full+2 mamba state pool": (FULL, MAMBA, MAMBA),
}


def snapshot(mgr: KVCacheManager):
    """Everything an allocation could change, in every pool."""
    return copy.deepcopy(
        (
            [(p.free_block_ids(), p.ref_cnt, p.cached, p.block_hash) for p in mgr.coordinator.pools],
            [(m.req_blocks, m.num_cached, m.anchors, m.retained) for m in mgr.coordinator.managers],
        )
    )


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        num_blocks=st.integers(8, 40),
        retention=st.sampled_from(RETENTION_RULES),
        num_states=st.integers(3, 12),
    )
    def setup(self, name, num_blocks, retention, num_states):
        groups = tuple(KVCacheGroup((f"l{i}",), s, BS) for i, s in enumerate(CONFIGS[name]))
        state_pool = StatePool(num_states=num_states) if name.endswith("state pool") else None
        config = KVCacheConfig(num_blocks=num_blocks, groups=groups, states=state_pool)
        self.mgr = KVCacheManager(config, max_model_len=64, retention=retention)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.next_id = 0

    @rule(
        arrivals=st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, 9), st.sampled_from([None, None, "s"])),
            min_size=1,
            max_size=4,
        )
    )
    def arrive(self, arrivals):
        for prefix, suffix, salt in arrivals:
            tokens = PREFIXES[prefix] + list(range(7 * self.next_id, 7 * self.next_id + suffix))
            self.waiting.append(Request(f"r{self.next_id}", tokens, cache_salt=salt))
            self.next_id += 1

    def _try(self, req, num_new, computed=0, hit=None, lookahead=0):
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(req, num_new, computed, hit, num_lookahead_tokens=lookahead)
        if out is None:
            assert snapshot(self.mgr) == before, "a failed allocation changed state"
        return out

    @precondition(lambda self: self.waiting)
    @rule(k=st.integers(0, 50), chunk=st.integers(1, 24))
    def admit(self, k, chunk):
        """Admit the longest-waiting requests while blocks last."""
        for _ in range(1 + k % 3):
            if self.waiting:
                self._admit(self.waiting[0], chunk)

    def _admit(self, req, chunk):
        hit, n = self.mgr.get_computed_blocks(req)
        assert n % BS == 0 and n < req.num_tokens
        num_new = self.mgr.chunk_limit(req, n, min(chunk, req.num_tokens - n))
        if num_new and self._try(req, num_new, n, hit) is not None:  # 0: no chunk ends where it must, wait
            req.num_computed_tokens = n + num_new
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(k=st.integers(0, 50), chunk=st.integers(1, 24), lookahead=st.integers(0, 3))
    def step(self, k, chunk, lookahead):
        """Continue a prefill chunk, or decode one token; preempt when out of blocks."""
        req = self.running[k % len(self.running)]
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens + lookahead >= 64:
                return self.finish(k)
            req.append_output_token_ids(k % 97)
        num_new = self.mgr.chunk_limit(
            req, req.num_computed_tokens, min(chunk, req.num_tokens - req.num_computed_tokens)
        )
        if not num_new:  # vLLM's layout: no chunk this short ends on a block boundary, the request waits
            return
        if self._try(req, num_new, lookahead=lookahead) is None:
            self.mgr.free(req)
            req.num_computed_tokens = 0
            self.running.remove(req)
            self.waiting.append(req)
        else:
            req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(k=st.integers(0, 50))
    def finish(self, k):
        req = self.running.pop(k % len(self.running))
        self.mgr.free(req)

    @rule(block=st.integers(0, 39))
    def evict(self, block):
        self.mgr.evict_blocks([block % self.mgr.pool.num_blocks])

    @rule()
    def reset(self):
        assert self.mgr.reset_prefix_cache() == (not self.running)

    @rule(bad=st.sampled_from(["free_unknown", "negative", "too_long"]))
    def bad_call_changes_nothing(self, bad):
        before = snapshot(self.mgr)
        req = Request("never-admitted", [1, 2, 3])
        with pytest.raises(KVCacheManagerError):
            if bad == "free_unknown":
                self.mgr.free(req)
            elif bad == "negative":
                self.mgr.allocate_slots(req, -1)
            else:
                self.mgr.allocate_slots(req, 65)
        assert snapshot(self.mgr) == before

    # ------------------------------------------------------------ invariants
    @invariant()
    def blocks_are_free_xor_referenced_with_exact_ref_counts(self):
        if not hasattr(self, "mgr"):
            return
        for pool in self.mgr.coordinator.pools:
            holders = [0] * pool.num_blocks
            owner_group: dict[int, int] = {}
            for g, m in enumerate(self.mgr.coordinator.managers):
                assert set(m.req_blocks) == {r.request_id for r in self.running}
                if m.pool is not pool:
                    continue
                for blocks in m.req_blocks.values():
                    real = [b for b in blocks if b]
                    assert len(real) == len(set(real)), "a block appears twice in one request"
                    for b in real:
                        holders[b] += 1
                        assert owner_group.setdefault(b, g) == g, "a block is used by two groups"
            assert pool.ref_cnt[0] == 0 and not pool.is_free(0)
            for b in range(1, pool.num_blocks):
                assert pool.ref_cnt[b] == holders[b]
                assert pool.is_free(b) == (holders[b] == 0)
            used = sum(1 for b in range(1, pool.num_blocks) if holders[b])
            assert pool.num_free_blocks + used == pool.num_blocks - 1
            empty = sum(1 for b in range(1, pool.num_blocks) if not holders[b] and not pool.is_cached(b))
            assert pool.num_empty_free_blocks == empty

    @invariant()
    def groups_of_one_type_hold_alike_counts_where_their_rules_say_so(self):
        """The coordinator lets one group's counts answer for its whole type."""
        if not hasattr(self, "mgr"):
            return
        coordinator = self.mgr.coordinator
        for t in coordinator.types:
            managers = [coordinator.managers[g] for g in t.group_ids]
            if not managers[0].counts_alike_within_type:
                continue
            for req in self.running:
                rid = req.request_id
                counts = {(len(m.req_blocks[rid]), m.num_cached.get(rid), m.skip_frontier.get(rid)) for m in managers}
                assert len(counts) == 1, f"groups {t.group_ids} of one type differ for {rid}: {counts}"

    @invariant()
    def retained_blocks_belong_to_running_requests(self):
        if not hasattr(self, "mgr"):
            return
        recorded = {b for m in self.mgr.coordinator.managers for kept in m.retained.values() for _, b in kept}
        retained = {b for b in self.mgr.pool.free_block_ids() if self.mgr.pool.is_retained(b)}
        assert retained <= recorded

    @invariant()
    def cached_blocks_hold_the_tokens_their_hash_names(self):
        if not hasattr(self, "mgr"):
            return
        for pool in self.mgr.coordinator.pools:
            for g, m in enumerate(pool.cached):
                for h, b in m.items():
                    assert pool.block_hash[b] == h and pool.block_group[b] == g
        for req in self.running:
            for g, blocks in enumerate(self.mgr.get_block_ids(req.request_id)):
                pool = self.mgr.coordinator.managers[g].pool
                for i, b in enumerate(blocks):
                    if b and pool.block_hash[b] is not None:
                        assert pool.block_hash[b] == req.block_hashes[i]
                        assert (i + 1) * BS <= req.num_computed_tokens

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in self.running:
            self.mgr.free(req)
        for pool in self.mgr.coordinator.pools:
            assert pool.num_free_blocks == pool.num_blocks - 1
        assert self.mgr.usage == 0.0
        assert not any(self.mgr.pool.is_retained(b) for b in range(self.mgr.pool.num_blocks))


ManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = pytest.mark.slow(ManagerMachine.TestCase)


# --------------------------------------------------------------------------
class VllmRulesReference:
    """vLLM v1's single-group decisions, written as plainly as possible: a Python
    list as the free queue, tuples of all tokens up to a block's end as hashes, and
    every computed copy of a block cached (a lookup finds the oldest copy left)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free_queue = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, tuple] = {}
        self.block_of: dict[tuple, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def key(self, tokens, i):
        return tuple(tokens[: (i + 1) * self.bs])

    def lookup(self, tokens) -> list[int]:
        hit = []
        for i in range((len(tokens) - 1) // self.bs):
            copies = self.block_of.get(self.key(tokens, i))
            if not copies:
                break
            hit.append(copies[0])
        return hit

    def allocate(self, rid, tokens, hit, num_slots) -> bool:
        held = self.blocks.get(rid, [])
        need = -(-num_slots // self.bs) - len(held) - len(hit)
        if max(need, 0) + sum(1 for b in hit if self.ref[b] == 0) > len(self.free_queue):
            return False
        for b in hit:
            if self.ref[b] == 0:
                self.free_queue.remove(b)
            self.ref[b] += 1
        blocks = self.blocks.setdefault(rid, list(hit))
        for _ in range(max(need, 0)):
            b = self.free_queue.pop(0)
            if b in self.hash_of:
                self.block_of[self.hash_of.pop(b)].remove(b)
            self.ref[b] = 1
            blocks.append(b)
        for i in range(min(len(tokens), num_slots) // self.bs):
            k = self.key(tokens, i)
            if blocks[i] not in self.hash_of:
                self.hash_of[blocks[i]] = k
                self.block_of.setdefault(k, []).append(blocks[i])
        return True

    def free(self, rid):
        for b in reversed(self.blocks.pop(rid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.free_queue.append(b)
                else:
                    self.free_queue.insert(0, b)


@settings(max_examples=120, deadline=None)
@given(
    num_blocks=st.integers(6, 30),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "admit_whole_blocks", "decode", "free"]), st.integers(0, 2), st.integers(0, 30)
        ),
        max_size=50,
    ),
)
def test_single_full_group_decides_exactly_like_the_vllm_rules(num_blocks, ops):
    """Same hit lengths, same block ids, same free-queue (eviction) order, step by step.

    Unhashed freed blocks go to the head, as in vLLM 0.33. Prompts of whole blocks
    recompute their last block (a hit stops below the last token), so the same block
    is computed twice and both copies are cached."""
    config = KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroup(("l",), FULL, BS),))
    mgr = KVCacheManager(config, max_model_len=256)
    ref = VllmRulesReference(num_blocks, BS)
    running: dict[str, Request] = {}
    for n, (op, prefix, k) in enumerate(ops):
        if op.startswith("admit"):
            if op == "admit":
                req = Request(f"r{n}", [*PREFIXES[prefix][: 4 + k], k, n])
            else:
                req = Request(f"r{n}", PREFIXES[prefix][: BS * (1 + k % 4)])
            hit, num_hit = mgr.get_computed_blocks(req)
            ref_hit = ref.lookup(req.all_token_ids)
            assert list(hit.get_block_ids()[0]) == ref_hit and num_hit == len(ref_hit) * BS
            ok = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
            assert ok == ref.allocate(req.request_id, req.all_token_ids, ref_hit, req.num_tokens)
            if ok:
                req.num_computed_tokens = req.num_tokens
                running[req.request_id] = req
        elif running:
            req = list(running.values())[k % len(running)]
            if op == "decode" and req.num_tokens < 200:
                req.append_output_token_ids(k)
                ok = mgr.allocate_slots(req, 1) is not None
                assert ok == ref.allocate(req.request_id, req.all_token_ids, [], req.num_tokens)
                if ok:
                    req.num_computed_tokens += 1
                    continue
            mgr.free(req)
            ref.free(req.request_id)
            del running[req.request_id]
        assert mgr.pool.free_block_ids() == ref.free_queue
        for rid in running:
            assert mgr.get_block_ids(rid)[0] == ref.blocks[rid]
