"""The host block allocator: blocks from 1 (0 is scratch), refusals that change nothing."""

import pytest

from jaxkv.errors import JaxkvError
from jaxkv.offload.host_blocks import HostBlockBackend, HostBlocksError


def test_backend_hands_out_host_blocks_from_one_and_never_scratch():
    backend = HostBlockBackend(3)
    assert backend.allocate(3) == [1, 2, 3] and backend.num_free == 0 and backend.num_allocated == 3
    with pytest.raises(HostBlocksError, match="cannot allocate 1"):
        backend.allocate(1)


def test_backend_free_of_an_unallocated_host_block_raises_and_changes_nothing():
    backend = HostBlockBackend(3)
    backend.allocate(2)
    with pytest.raises(HostBlocksError, match="3"):
        backend.free([1, 3])
    with pytest.raises(HostBlocksError):
        backend.free([1, 1])
    assert backend.num_free == 1
    backend.free([2, 1])
    assert backend.num_free == 3 and backend.num_allocated == 0


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True, None])
def test_a_bad_capacity_is_named(capacity):
    with pytest.raises(JaxkvError, match="capacity"):
        HostBlockBackend(capacity)
