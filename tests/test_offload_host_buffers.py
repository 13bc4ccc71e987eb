"""The host buffer: memory kinds, generation counters, rows read back as copies, DMAs only."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.offload.host_buffers import (
    HostBuffersError,
    HostKVBuffers,
    blocks_in_budget,
    pinned_host_supported,
    pinned_ops,
)


def test_blocks_in_budget():
    assert blocks_in_budget(1000, 300) == 3
    with pytest.raises(HostBuffersError, match="299"):
        blocks_in_budget(299, 300)


def test_cpu_jax_has_pinned_host():
    """CPU jax 0.10 exposes pinned_host memory and computes on it."""
    assert pinned_host_supported(jax.devices("cpu")[0])
    pool = HostKVBuffers(2, (1, 2), np.float32)
    assert pool.memory_kind == "pinned_host"
    assert pool.buffers[0].sharding.memory_kind == "pinned_host"


def test_unknown_memory_kind_raises():
    with pytest.raises(HostBuffersError, match="'unpinned_host'"):
        HostKVBuffers(2, (1, 2), np.float32, memory_kind="unpinned_host")


def test_generations_bump_per_writer_and_release():
    pool = HostKVBuffers(3, (1,), np.float32, memory_kind="numpy")
    first = pool.bump([1, 2, 0])
    assert first.tolist() == [1, 1, 0]  # the scratch host block stays at 0
    assert pool.current([1, 2], first[:2]).all()
    pool.release([2])
    assert pool.current([1, 2], first[:2]).tolist() == [True, False]
    with pytest.raises(HostBuffersError, match="4"):
        pool.release([4])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("memory_kind", ["pinned_host", "numpy"])
def test_rows_are_copies_so_a_later_store_still_writes(dtype, memory_kind):
    """Reading rows must hold no reference to the buffer a later write donates (on a GPU a
    zero-copy view of a bf16 pinned_host buffer made that write fail)."""
    pool = HostKVBuffers(3, (2, 4), dtype, memory_kind=memory_kind)
    ones = jnp.ones((1, 2, 4), dtype)
    if memory_kind == "pinned_host":
        pool.write(np.array([1]), ones)
    else:
        pool.commit(np.array([1]), np.asarray(ones))
    first = pool.rows([1, 2])
    first[0] = 7  # a copy: the pool is unchanged
    if memory_kind == "pinned_host":
        pool.write(np.array([2]), ones * 2)
    else:
        pool.commit(np.array([2]), np.asarray(ones * 2))
    again = pool.rows([1, 2])
    assert again.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(again.astype(np.float32), [np.ones((2, 4)), 2 * np.ones((2, 4))])


# ------------------------------------------------------- no compute in host memory
def host_memory_compute(jitted, *args) -> tuple[list[str], collections.Counter]:
    """Ops of ``jitted``'s GPU lowering that compute on values in host memory, and the
    count of each op kind that touches them.

    CPU lowering drops moves between memories inside a jit (only the arguments' and
    results' memory kinds survive, and compiled CPU HLO shows ``S(5)`` only in the entry
    layout), so the module is exported for CUDA, where each move is an
    ``annotate_device_placement`` custom call that XLA's host offloader reads. Host
    values: arguments of memory kind pinned_host, values moved to pinned_host, and
    dynamic-update-slices of a host value. Allowed on them: a dynamic-update-slice of a
    host value by a host value (a DMA into host memory), a dynamic-slice moved straight
    to the device (a DMA out of it), moves, and returning them. Anything else (a gather,
    a scatter, arithmetic) is host compute.
    """
    text = jax.export.export(jitted, platforms=["cuda"])(*args).mlir_module()
    signature = next(line for line in text.splitlines() if "func.func public @main" in line)
    params = signature.split(") -> (")[0]
    host = {m.group(1) for m in re.finditer(r"(%arg\d+)[^%]*", params) if '"pinned_host"' in m.group(0)}
    sliced: set[str] = set()  # dynamic-slices of host values, which must move to the device at once
    bad, touching = [], collections.Counter()
    for line in text.splitlines():
        m = re.match(r'\s*(%[\w#]+)(?::\d+)? = "?([\w.]+)"?(.*)', line)
        if not m:
            continue
        result, op, rest = m.groups()
        operands = re.findall(r"%[\w#]+", re.sub(r"loc\(.*", "", rest))
        on_host = [x in host for x in operands]
        if any(x in sliced for x in operands):
            if op == "stablehlo.custom_call" and '_xla_buffer_placement = "device"' in rest:
                touching["dynamic_slice_to_device"] += 1
                continue
            bad.append(line.strip())
        if op == "stablehlo.custom_call" and "@annotate_device_placement" in rest:
            if '_xla_buffer_placement = "pinned_host"' in rest:
                host.add(result)
            continue
        if not any(on_host):
            continue
        touching[op] += 1
        if op == "stablehlo.dynamic_update_slice" and on_host[:2] == [True, True] and not any(on_host[2:]):
            host.add(result)
        elif op == "stablehlo.dynamic_slice" and on_host[0] and not any(on_host[1:]):
            sliced.add(result)
        else:
            bad.append(line.strip())
    return bad, touching


def old_gather_scatter_ops(device):
    """What the pool ran before: a scatter into and a gather out of the host buffer."""
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    to_host = functools.partial(jax.device_put, device=jax.memory.Space.Host)
    write = jax.jit(
        lambda buf, idx, rows: buf.at[to_host(idx)].set(to_host(rows)), donate_argnums=0, out_shardings=host
    )
    read = jax.jit(lambda buf, idx: jax.device_put(buf[to_host(idx)], jax.memory.Space.Device))
    return write, read


def pinned_args(rows: int):
    pool = HostKVBuffers(9, (2, 3, 4), jnp.bfloat16, memory_kind="pinned_host")
    return pool.buffers[0], jnp.arange(1, rows + 1, dtype=jnp.int32), jnp.ones((rows, 2, 3, 4), jnp.bfloat16)


@pytest.mark.parametrize("rows", [1, 4])
def test_pinned_writes_and_reads_are_row_dmas_not_host_compute(rows):
    buf, idx, data = pinned_args(rows)
    write, read = pinned_ops(jax.devices()[0])
    bad, touching = host_memory_compute(write, buf, idx, data)
    assert not bad, bad
    assert touching == {"stablehlo.dynamic_update_slice": rows}
    bad, touching = host_memory_compute(read, buf, idx)
    assert not bad, bad
    assert touching == {"stablehlo.dynamic_slice": rows, "dynamic_slice_to_device": rows}


def test_the_check_catches_gathers_and_scatters_on_the_host_buffer():
    buf, idx, data = pinned_args(4)
    write, read = old_gather_scatter_ops(jax.devices()[0])
    assert any("stablehlo.scatter" in op for op in host_memory_compute(write, buf, idx, data)[0])
    assert any("stablehlo.gather" in op for op in host_memory_compute(read, buf, idx)[0])
    doubled = jax.jit(lambda buf: buf * 2)
    assert host_memory_compute(doubled, buf)[0]
