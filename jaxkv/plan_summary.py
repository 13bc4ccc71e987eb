"""The plan as text: the table and the lines that ``python -m jaxkv.commands.plan`` prints.

Kept apart from the planner, which decides; this module only reads a
:class:`~jaxkv.planner.KVCacheConfig` through its public fields and properties.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxkv.specs import AttentionSpec

if TYPE_CHECKING:
    from jaxkv.planner import KVCacheConfig


def plan_summary(config: KVCacheConfig) -> str:
    """A readable table of ``config``: groups, pages, blocks, states, padding, per-device bytes."""
    rows = [("group", "spec", "layers", "block", "data B/page", "pad B/block", "blocks/req")]
    padding = config.padding_bytes_per_block
    per_request = config.blocks_per_request() if config.max_model_len is not None else None
    per_block = f"/{config.pages.num_layers_per_block}" if config.pages is not None else ""
    states = set(config.state_group_ids)
    for i, g in enumerate(config.groups):
        rows.append(
            (
                str(i),
                g.spec.label
                + ((" (state pool)" if config.shared_states is None else " (shared pages)") if i in states else ""),
                f"{len(g.layer_names)}{'' if i in states else per_block}",
                str(g.block_size),
                f"{g.spec.page_size_bytes(g.block_size):,}",
                f"{padding[i]:,}" if padding is not None else "-",
                f"{per_request[i]:,}" if per_request is not None else "-",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    table = [
        "  ".join(
            cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines = [_headline(config), *table]
    if config.head_dim_multiple > 1:
        lines.append(
            f"attention head_size rounded up to a multiple of {config.head_dim_multiple} "
            "(tile alignment): data B/page includes the zero head columns, pad B/block "
            "counts them"
        )
    if config.pages is not None:
        block = config.pages.block_bytes
        lines.append(
            f"page {config.pages.page_size_bytes:,} B per layer; block = "
            f"{config.pages.num_layers_per_block} layer page(s) = {block:,} B ({_human(block)})"
        )
        used = f" = {_human(config.num_blocks * block)}"
        if config.memory_bytes is not None and config.state_pool is None:
            used += f" of {_human(config.memory_bytes)}"
    else:
        used = ""
    lines.append(
        f"num_blocks {config.num_blocks:,}{used}; block 0 is the null block "
        f"(never handed out): {config.num_usable_blocks:,} usable"
    )
    if config.state_pool is not None:
        lines.extend(_state_pool_lines(config))
    if config.shared_states is not None:
        lines.extend(_shared_pages_lines(config))
    if config.tensor_parallel > 1:
        lines.append(_device_line(config))
    if per_request is not None:
        need = config.attention_blocks_per_request()
        line = f"max_model_len {config.max_model_len:,}: one request needs {need:,} blocks"
        if config.pages is not None:
            line += f" ({_human(need * config.pages.block_bytes)})"
        if states and config.shared_states is None:
            line += f" + {len(states)} live state(s)"
        elif states:
            line += f" (its {len(states)} live state(s) included)"
        lines.append(f"{line}; max concurrency {config.max_concurrency:,}")
        if config.pages is not None:
            assert padding is not None  # a plan with pages has its padding
            wasted = sum(
                (n if i not in states else 1) * p
                for i, (n, p) in enumerate(zip(per_request, padding, strict=True))
                if i not in states or config.shared_states is not None
            )
            share = wasted / (need * config.pages.block_bytes)
            lines.append(
                f"padding: {_human(wasted)} of a max_model_len request's blocks ({share:.1%}) "
                "holds no data (empty layer pages, states padded to the page, heads padded to tiles)"
            )
    return "\n".join(lines)


def _state_pool_lines(config: KVCacheConfig) -> list[str]:
    """The summary's split of the budget between the attention blocks and the state pool."""
    pool = config.state_pool
    assert pool is not None  # called for plans with a state pool
    if pool.state_bytes is None:
        return [f"state pool: {pool.num_states:,} states (state 0 is the null state)"]
    row_bytes = pool.state_bytes
    total_bytes = pool.num_states * row_bytes
    lines = [
        f"state row {row_bytes:,} B ({_human(row_bytes)}): the states of one recurrent group's layers for one request"
    ]
    if pool.num_live_states is not None:
        checkpoints = pool.num_states - 1 - pool.num_live_states
        lines.append(
            f"state pool: {pool.num_live_states:,} live x {_human(row_bytes)} = "
            f"{_human(pool.num_live_states * row_bytes)}"
            f" + {checkpoints:,} checkpoint(s) = {_human(checkpoints * row_bytes)} + the null state"
            f" = {pool.num_states:,} states = {_human(total_bytes)}"
        )
    attention = config.num_blocks * config.pages.block_bytes if config.pages is not None else 0
    both = _human(attention + total_bytes)
    total = f"total {_human(attention)} attention + {_human(total_bytes)} states = {both}"
    if config.memory_bytes is not None:
        total += f" of {_human(config.memory_bytes)}"
    lines.append(f"{total}; prefix-cache granularity (hash block size) {config.hash_block_size} tokens")
    return lines


def _shared_pages_lines(config: KVCacheConfig) -> list[str]:
    """The summary's account of the one memory: what a state weighs in pages, what the pool holds."""
    shared = config.shared_states
    assert shared is not None and config.pages is not None  # called for shared-pages plans: states are pages
    k = shared.pages_per_state
    block = config.pages.block_bytes
    usable = config.num_usable_blocks
    tokens = usable * config.hash_block_size
    lines = [
        f"one memory: a state ({_human(shared.state_bytes)}: one recurrent group's layers, one request) takes "
        f"{k:,} block(s) of the pool ({_human(k * block)}, as much as {k * config.hash_block_size:,} tokens of KV)",
        f"the {usable:,} usable blocks hold KV blocks, live states and state checkpoints in any mix, "
        f"e.g. {tokens:,} tokens of KV alone, or {usable // k:,} states alone; "
        "live states are never evicted, checkpoints and KV blocks leave in one eviction order",
    ]
    if config.memory_bytes is not None:
        lines.append(
            f"total {_human(config.num_blocks * block)} of {_human(config.memory_bytes)}; "
            f"prefix-cache granularity (hash block size) {config.hash_block_size} tokens"
        )
    return lines


def _device_line(config: KVCacheConfig) -> str:
    """The summary's memory per tensor-parallel device."""
    tp = config.tensor_parallel
    spec = config.attention_groups[0].spec
    assert isinstance(spec, AttentionSpec)  # tensor_parallel > 1 is refused for other specs
    heads = spec.num_kv_heads
    line = f"per device (tensor_parallel={tp}, {heads // tp} of {heads} KV heads each):"
    if config.pages is not None:
        block = config.pages.block_bytes // tp
        line += f" block {block:,} B, attention {_human(config.num_blocks * block)}"
    if config.state_pool is not None and config.state_pool.total_bytes is not None:
        line += f" + states {_human(config.state_pool.total_bytes)} (replicated)"
    device_bytes = config.device_bytes
    return line if device_bytes is None else f"{line} = {_human(device_bytes)}"


def _headline(config: KVCacheConfig) -> str:
    """The summary's first line: groups, pages, layout, where the states live, the hash block size."""
    head = f"KV cache plan: {len(config.groups)} group(s)"
    if config.pages is not None:
        head += f" x {config.pages.num_layers_per_block} layer page(s), {config.pages.layout} layout"
    if config.state_pool is not None:
        head += f", {len(config.state_group_ids)} on a state pool"
    if config.shared_states is not None:
        head += f", {len(config.state_group_ids)} recurrent with states on the same pages"
    return f"{head}, hash block size {config.hash_block_size} tokens"


def exact_bytes(num_bytes: int) -> str:
    """Exact bytes and a readable size: "2,097,152 B (2.00 MiB)"."""
    return f"{num_bytes:,} B" + ("" if num_bytes < 1 << 10 else f" ({_human(num_bytes)})")


def _human(num_bytes: int) -> str:
    """A readable size in GiB, MiB, KiB or B: "2.00 MiB"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"
