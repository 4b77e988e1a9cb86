"""Capacities as the simulator's users write them: a block count, or a share of the trace.

``kvgate simulate -c 2%`` and ``kvgate analyze --gpu 2%`` read a GPU capacity the same way,
so both parse it here: an integer is a block count, ``N%`` a share of the trace's distinct
blocks (at least one block). A host capacity is a block count or a multiple of the GPU's
(``4x``); ``0`` means no host tier. Invariant: every capacity returned is >= 1 block (GPU)
or >= 0 blocks (host); a GPU capacity above 16 x the distinct blocks is refused
(``check_blocks``, which the caller applies to a resolved host capacity too).
"""

from __future__ import annotations

import math
from collections.abc import Callable


class CapacityError(ValueError):
    """A capacity the simulator cannot use (not a positive count, share or multiple)."""


MAX_DISTINCT_MULTIPLE = 16
"""A tier larger than this many times the trace's distinct blocks is refused: a pool of the
distinct blocks already holds everything, and a huge count only exhausts memory."""


def check_blocks(blocks: int, distinct_pool_blocks: int, what: str) -> int:
    """``blocks`` unchanged, or CapacityError when above the bound (``what`` names the option)."""
    limit = MAX_DISTINCT_MULTIPLE * max(1, distinct_pool_blocks)
    if blocks > limit:
        raise CapacityError(
            f"{what} is {blocks} blocks, more than {MAX_DISTINCT_MULTIPLE} x the trace's {distinct_pool_blocks} "
            f"distinct blocks ({limit}); a pool of {distinct_pool_blocks} blocks already holds everything"
        )
    return blocks


def parse_capacity(text: str, distinct_pool_blocks: int) -> int:
    """``"439"`` → 439 blocks; ``"1%"`` → 1 % of the distinct blocks (at least 1)."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            share = float(raw[:-1])
            if not math.isfinite(share) or share <= 0:
                raise ValueError
            value = max(1, round(distinct_pool_blocks * share / 100.0))
        else:
            value = int(raw)
    except ValueError:
        raise CapacityError(f"capacity {text!r} must be a positive block count or a percentage like 2%") from None
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
            return lambda gpu: round(gpu * factor)
        blocks = int(raw)
        if blocks < 0:
            raise ValueError
    except ValueError:
        raise CapacityError(f"--host {text!r} must be a block count or a multiple like 4x") from None
    return lambda gpu: blocks
