"""Capacities as the simulator's users write them: a block count, or a share of the trace.

``kvgate simulate -c 2%`` and ``kvgate analyze --gpu 2%`` read a GPU capacity the same way,
so both parse it here: an integer is a block count, ``N%`` a share of the trace's distinct
blocks (at least one block). A host capacity is a block count or a multiple of the GPU's
(``4x``); ``0`` means no host tier. Invariant: every capacity returned is >= 1 block (GPU)
or >= 0 blocks (host); a GPU capacity above 16 x the distinct blocks is refused
(``check_blocks``, which the caller applies to a resolved host capacity too). A share or a
multiple too large to be a count (``1e308%``, ``1e308x``) is a CapacityError as well, never
an OverflowError, and no message prints a count longer than a float holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from retention.trace import TraceRequest, distinct_blocks


class CapacityError(ValueError):
    """A capacity the simulator cannot use (not a positive count, share or multiple)."""


MAX_DISTINCT_MULTIPLE = 16
"""A tier larger than this many times the trace's distinct blocks is refused: a pool of the
distinct blocks already holds everything, and a huge count only exhausts memory."""

_MAX_HOST_BLOCKS = 2**53
"""A host multiple resolving above this is refused before it is rounded: past it a float no longer
holds every count, and no trace has this many distinct blocks (the bound above refuses it anyway)."""


def check_blocks(blocks: int, distinct_pool_blocks: int, what: str) -> int:
    """``blocks`` unchanged, or CapacityError when above the bound (``what`` names the option)."""
    limit = MAX_DISTINCT_MULTIPLE * max(1, distinct_pool_blocks)
    if blocks > limit:
        raise CapacityError(
            f"{what} is {blocks} blocks, more than {MAX_DISTINCT_MULTIPLE} x the trace's {distinct_pool_blocks} "
            f"distinct blocks ({limit}); a pool of {distinct_pool_blocks} blocks already holds everything"
        )
    return blocks


def distinct_pool_blocks(requests: Iterable[TraceRequest], trace_block_size: int, pool_block_size: int) -> int:
    """Distinct blocks of the trace's prompts cut at the pool's block size: the base of ``N%``.

    At the trace's own block size this is its distinct hash ids (``distinct_blocks``). At another
    size, pool block ``k`` of a prompt (``ceil(prompt / pool_block_size)`` blocks, the last one
    possibly partial, as at the trace's size) is identified by its position and the hash ids its
    prompt prefix covers, so it is counted once however many requests share it, whether the pool's
    blocks are larger or smaller than the trace's. The prompt is the one the simulator builds:
    ``input_length`` tokens, cut at what the hash ids cover. Linear in the trace's hash ids.
    """
    if pool_block_size == trace_block_size:
        return distinct_blocks(requests)
    prefixes: dict[tuple[int, int], int] = {}  # (parent prefix, hash id) -> prefix id; -1: empty
    seen: set[tuple[int, int]] = set()  # (prefix id of the covered hash ids, pool block index)
    for request in requests:
        ids = request.hash_ids
        length = min(request.input_length, len(ids) * trace_block_size)
        nodes = [-1]  # nodes[i]: the prefix id of ids[:i]
        for block in range(-(-length // pool_block_size)):
            end = min((block + 1) * pool_block_size, length)
            covered = -(-end // trace_block_size)
            while len(nodes) <= covered:
                key = (nodes[-1], ids[len(nodes) - 1])
                nodes.append(prefixes.setdefault(key, len(prefixes)))
            seen.add((nodes[covered], block))
    return len(seen)


def parse_capacity(text: str, distinct_pool_blocks: int) -> int:
    """``"439"`` → 439 blocks; ``"1%"`` → 1 % of the distinct blocks (at least 1)."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            share = float(raw[:-1])
            if not math.isfinite(share) or share <= 0:
                raise ValueError
            value = None if share > 100 * MAX_DISTINCT_MULTIPLE else max(1, round(distinct_pool_blocks * share / 100.0))
        else:
            value = int(raw)
    except ValueError:
        raise CapacityError(f"capacity {text!r} must be a positive block count or a percentage like 2%") from None
    if value is None:  # refused before rounding: 1e308% of the distinct blocks overflows
        raise CapacityError(
            f"capacity {text!r} is more than {100 * MAX_DISTINCT_MULTIPLE}% ({MAX_DISTINCT_MULTIPLE} x) of the trace's "
            f"{distinct_pool_blocks} distinct blocks; a pool of {distinct_pool_blocks} blocks already holds everything"
        )
    if value < 1:
        raise CapacityError(f"capacity {text!r} must be >= 1 block")
    return check_blocks(value, distinct_pool_blocks, f"capacity {text!r}")


def parse_host(text: str) -> Callable[[int], int]:
    """``"4x"`` → 4 × GPU; ``"1756"`` → fixed blocks; ``"0"`` → no host tier."""
    raw = text.strip().lower()
    try:
        if raw.endswith("x"):
            factor = float(raw[:-1])
            if not math.isfinite(factor) or factor < 0:
                raise ValueError
            return lambda gpu: _host_multiple(text, factor, gpu)
        blocks = int(raw)
        if blocks < 0:
            raise ValueError
    except ValueError:
        raise CapacityError(f"--host {text!r} must be a block count or a multiple like 4x") from None
    return lambda gpu: blocks


def _host_multiple(text: str, factor: float, gpu: int) -> int:
    """``factor`` x ``gpu`` blocks, rounded; CapacityError when too large to be a block count."""
    blocks = gpu * factor
    if not math.isfinite(blocks) or blocks > _MAX_HOST_BLOCKS:
        raise CapacityError(
            f"--host {text!r} at GPU {gpu} blocks is more than {_MAX_HOST_BLOCKS:.3g} blocks; a host tier is at most "
            f"{MAX_DISTINCT_MULTIPLE} x the trace's distinct blocks"
        )
    return round(blocks)
