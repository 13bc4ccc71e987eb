"""jaxkv's manager in place of EasyDeL eSurge's ``CacheManager`` (:mod:`jaxkv.interop.easydel`).

One hybrid request stream (full attention + a sliding window) driven as eSurge's scheduler
drives its manager: admit (hit lookup, allocate the rest), decode, preempt, finish. Replayed
through :class:`~jaxkv.interop.easydel.JaxkvCacheManager`, and, where EasyDeL 0.3's files are
importable (``pip install --no-deps easydel==0.3.0``: its own dependencies pin jax 0.9, so
the package is not imported, only its host-side ``esurge/core`` modules with stand-ins for
its request and logger), through eSurge's own ``CacheManager``: the prefix hits are the same
at every step, and the page ids too but where a free hands back pages that were never cached
(jaxkv reuses those first, as current vLLM does; eSurge queues them behind cached pages).
"""

import dataclasses
import enum
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_configs import FULL, make_config, window

from jaxkv.core import KVCacheManager
from jaxkv.interop.easydel import EasydelAdapterError, JaxkvCacheManager

PAGE, WINDOW, NUM_PAGES = 4, 8, 24


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2


@dataclasses.dataclass
class EngineRequest:
    """The fields of eSurge's ``EngineRequest`` its cache manager reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    sampling_params: Any = None
    status: Status = Status.WAITING

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def jaxkv_manager() -> JaxkvCacheManager:
    config = make_config(NUM_PAGES, FULL, window(WINDOW), block_size=PAGE)
    return JaxkvCacheManager(KVCacheManager(config, max_model_len=256))


@pytest.fixture(scope="module")
def esurge_core() -> Iterator[types.SimpleNamespace]:
    """eSurge's ``core.manager`` and ``core.interface`` loaded from an installed EasyDeL
    without running its package ``__init__`` files (which import its whole jax 0.9 stack)."""
    spec = importlib.util.find_spec("easydel")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("EasyDeL is not installed (pip install --no-deps easydel==0.3.0 brings its host-side files)")
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {k: v for k, v in sys.modules.items() if k == "easydel" or k.startswith("easydel.")}
    for name, sub in [
        ("easydel", "."),
        ("easydel.inference", "inference"),
        ("easydel.inference.esurge", "inference/esurge"),
        ("easydel.inference.esurge.core", "inference/esurge/core"),
    ]:
        package = types.ModuleType(name)
        package.__path__ = [str(root / sub)]
        sys.modules[name] = package
    request = types.ModuleType("easydel.inference.esurge.request")
    request.EngineRequest, request.EngineRequestStatus = EngineRequest, Status  # type: ignore[attr-defined]
    sys.modules[request.__name__] = request
    logger = types.ModuleType("easydel.inference.esurge.logger")
    logger.logger = logging.getLogger("esurge")  # type: ignore[attr-defined]
    sys.modules[logger.__name__] = logger
    try:
        yield types.SimpleNamespace(
            manager=importlib.import_module("easydel.inference.esurge.core.manager"),
            interface=importlib.import_module("easydel.inference.esurge.core.interface"),
        )
    finally:
        for k in [k for k in sys.modules if k == "easydel" or k.startswith("easydel.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def esurge_groups(core: types.SimpleNamespace) -> list[Any]:
    import jax.numpy as jnp

    iface = core.interface
    full = iface.FullAttentionSpec(page_size=PAGE, num_kv_heads=1, head_size=1, dtype=jnp.float32, use_mla=False)
    swa = iface.SlidingWindowSpec(
        page_size=PAGE, num_kv_heads=1, head_size=1, dtype=jnp.float32, use_mla=False, sliding_window=WINDOW
    )
    return [iface.CacheGroupSpec(kv_cache_spec=full, layer_names=["g0"]), iface.CacheGroupSpec(swa, ["g1"])]


def esurge_manager(core: types.SimpleNamespace) -> Any:
    return core.manager.CacheManager(num_pages=NUM_PAGES, kv_cache_groups=esurge_groups(core), max_model_len=256)


# ----------------------------------------------------------- the request stream
def admit(mgr: Any, req: EngineRequest) -> tuple[str, int, Any]:
    pages, n = mgr.get_computed_pages(req)
    new = mgr.allocate_slots(req, req.num_tokens - n, n, pages)
    assert new is not None
    req.num_computed_tokens, req.status = req.num_tokens, Status.RUNNING
    return ("admit " + req.request_id, n, mgr.get_page_ids(req.request_id))


def decode(mgr: Any, req: EngineRequest, token: int) -> tuple[str, int, Any]:
    req.output_token_ids.append(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    return ("decode " + req.request_id, 0, mgr.get_page_ids(req.request_id))


def preempt(mgr: Any, req: EngineRequest) -> tuple[str, int, Any]:
    mgr.free(req)
    req.num_computed_tokens, req.status = 0, Status.PREEMPTED
    return ("preempt " + req.request_id, 0, mgr.page_pool.get_num_free_pages())


def finish(mgr: Any, req: EngineRequest) -> tuple[str, int, Any]:
    mgr.free(req)
    mgr.free_page_hashes(req)
    return ("finish " + req.request_id, 0, mgr.page_pool.get_num_free_pages())


def stream(mgr: Any) -> list[tuple[str, int, Any]]:
    """Shared prefixes, a resend with its outputs, a preemption and re-admission, and an
    unrelated prompt that evicts: eSurge's scheduler's calls, in its order."""
    a = EngineRequest("a", list(range(22)))
    b = EngineRequest("b", [*range(16), *range(100, 110)])
    log = [admit(mgr, a), *(decode(mgr, a, 50 + i) for i in range(3)), finish(mgr, a)]
    log += [admit(mgr, b), decode(mgr, b, 60)]
    c = EngineRequest("c", [*range(22), 50, 51, 52, 7])
    log += [admit(mgr, c), preempt(mgr, b), admit(mgr, b), decode(mgr, b, 61), finish(mgr, b), finish(mgr, c)]
    d = EngineRequest("d", list(range(200, 240)))
    log += [admit(mgr, d), finish(mgr, d)]
    e = EngineRequest("e", list(range(22)))
    log.append(admit(mgr, e))
    log.append(("common prefix", 0, mgr.get_num_common_prefix_pages(e, 1)))
    return log


def test_jaxkv_stream_hits():
    log = stream(jaxkv_manager())
    hits = [(step.split()[1], n) for step, n, _ in log if step.startswith("admit")]
    # b shares a's 16 prompt tokens; c resends a with its outputs (24 tokens, 6 full pages);
    # b re-admitted finds its own 24; d evicts the window pages a's prefix needs, so e misses.
    assert hits == [("a", 0), ("b", 16), ("c", 24), ("b", 24), ("d", 0), ("e", 0)]


def test_esurge_manager_and_jaxkv_make_the_same_decisions_but_one(esurge_core):
    ours, theirs = stream(jaxkv_manager()), stream(esurge_manager(esurge_core))
    assert [(s, n) for s, n, _ in ours] == [(s, n) for s, n, _ in theirs], "the same hits at every step"
    frees = [(s, x) for s, _, x in ours if not s.startswith(("admit", "decode"))]
    assert frees == [(s, x) for s, _, x in theirs if not s.startswith(("admit", "decode"))], "and free pages"
    first = next(i for i, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y)
    assert ours[first][0] == "admit b" and ours[first - 1][0] == "finish a"
    # a's last page of each group (a partial page: never cached) went to b first in jaxkv only.
    a_partial = {ids[-1] for ids in ours[first - 2][2]}
    assert a_partial <= {p for ids in ours[first][2] for p in ids}
    assert not a_partial & {p for ids in theirs[first][2] for p in ids}


def test_built_from_esurge_groups_it_replays_the_same(esurge_core):
    built = JaxkvCacheManager.from_easydel(NUM_PAGES, esurge_groups(esurge_core), 256)
    assert stream(built) == stream(jaxkv_manager())


def test_after_a_free_jaxkv_reuses_never_cached_pages_first(esurge_core):
    """The one difference: a finished request's partial last page was never cached; jaxkv
    hands it out before any cached page, eSurge after them (behind the free queue)."""
    for mgr, uncached_first in ((jaxkv_manager(), True), (esurge_manager(esurge_core), False)):
        a = EngineRequest("a", list(range(10)))  # per group two full (cached) pages + one partial
        admit(mgr, a)
        partial = {ids[-1] for ids in mgr.get_page_ids("a")}
        finish(mgr, a)
        admit(mgr, EngineRequest("z", list(range(500, 504))))
        z_pages = {p for ids in mgr.get_page_ids("z") for p in ids}
        assert (z_pages == partial) is uncached_first and bool(z_pages & partial) is uncached_first


@dataclasses.dataclass
class MambaSpec:
    page_size: int = 1


def test_esurge_specs_without_a_counterpart_are_refused():
    with pytest.raises(EasydelAdapterError, match="MambaSpec"):
        JaxkvCacheManager.from_easydel(8, [types.SimpleNamespace(kv_cache_spec=MambaSpec(), layer_names=["m"])], 64)
    with pytest.raises(EasydelAdapterError, match="use_eagle"):
        JaxkvCacheManager.from_easydel(8, [], 64, use_eagle=True)


def test_refusals_change_nothing():
    mgr = jaxkv_manager()
    req = EngineRequest("a", list(range(8)))
    free = mgr.page_pool.get_num_free_pages()
    with pytest.raises(EasydelAdapterError, match="data_parallel_size"):
        mgr.get_computed_pages(req, data_parallel_size=2)
    with pytest.raises(EasydelAdapterError, match="delay_cache_pages"):
        mgr.allocate_slots(req, 8, delay_cache_pages=True)
    with pytest.raises(EasydelAdapterError, match="num_new_tokens"):
        mgr.allocate_slots(req, 0)
    assert mgr.page_pool.get_num_free_pages() == free and mgr.get_page_ids("a") == ([], [])
