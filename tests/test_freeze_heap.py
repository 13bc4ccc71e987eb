"""jaxkv.serving.engine.freeze_heap: what is alive leaves the collector's walk; garbage goes first."""

import gc
import weakref

from jaxkv.serving.engine import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_garbage_is_collected_first_and_what_lives_is_frozen():
    garbage, alive = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_heap()
        assert dead() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # out of every generation's walk
    finally:
        gc.unfreeze()
    assert any(obj is alive for obj in gc.get_objects())
