"""Value types of the pool API: configuration, copies, allocations, per-block retention.

Kept apart from ``retention/pool.py`` so the engine and the simulator can name them without
the pool's internals; ``retention.pool`` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from retention.types import MAX_PRIORITY, MIN_PRIORITY, RetentionPlan, Tier


class PoolError(ValueError):
    """Misuse of the pool API (unknown or duplicate request id, bad sizes, bad tokens)."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Pool shape; mirrors ``executor::KvCacheConfig`` (``executor.h``) where it can.

    ``secondary_offload_min_priority`` defaults to TensorRT-LLM's *code* default 30
    (``kDefaultSecondaryOffloadMinPriority`` in ``evictionPolicy.cpp``), inclusive.
    ``event_buffer_max_size``: ``None`` keeps every event until drained, 0 disables
    events, n keeps the newest n (``KvCacheConfig::eventBufferMaxSize``).
    """

    primary_blocks: int
    secondary_blocks: int = 0
    tokens_per_block: int = 32
    secondary_offload_min_priority: int = 30
    enable_block_reuse: bool = True
    event_buffer_max_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("primary_blocks", "secondary_blocks", "tokens_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PoolError(f"{name} must be an integer >= 0, got {value!r}")
        if self.primary_blocks < 1 or self.tokens_per_block < 1:
            raise PoolError("primary_blocks and tokens_per_block must be >= 1")
        if not MIN_PRIORITY <= self.secondary_offload_min_priority <= MAX_PRIORITY + 1:
            raise PoolError("secondary_offload_min_priority must be within [0, 101] (101 = never offload)")
        if self.event_buffer_max_size is not None and self.event_buffer_max_size < 0:
            raise PoolError("event_buffer_max_size must be None or >= 0")


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A physical KV copy the engine must execute, in list order, before the prefill."""

    src_tier: Tier
    src_slot: int
    dst_tier: Tier
    dst_slot: int


@dataclass(frozen=True, slots=True)
class Allocation:
    request_id: Hashable
    slots: tuple[int, ...]  # primary-tier slot per logical block, in sequence order
    num_cached_tokens: int  # prompt tokens already valid in those slots (full reused blocks)
    reused_blocks: int  # blocks matched in the radix tree (GPU or host)
    onboarded_blocks: int  # of those, copied host -> GPU for this request
    new_blocks: int  # freshly allocated blocks
    copies: tuple[BlockCopy, ...]  # offloads/onboards to run before this request's prefill


def per_block_retention(plan: RetentionPlan, num_blocks: int, bpt: int) -> list[tuple[int, int | None] | None]:
    """(priority, duration) per prompt block from the range holding its first token, None if uncovered.

    One sweep over blocks and ranges, like ``KvCacheRetentionConfig::
    getPerBlockRetentionPriorityDuration`` (``executor.h``).
    """
    if not plan.ranges:
        return [None] * num_blocks
    out: list[tuple[int, int | None] | None] = []
    ranges = plan.ranges
    r = 0
    for index in range(num_blocks):
        first = index * bpt
        while r < len(ranges) and ranges[r].end is not None and first >= ranges[r].end:  # type: ignore[operator]
            r += 1
        if r < len(ranges) and ranges[r].start <= first:
            out.append((ranges[r].priority, ranges[r].duration_ms))
        else:
            out.append(None)
    return out
