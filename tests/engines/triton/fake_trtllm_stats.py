"""Iteration statistics of the ``fake_trtllm`` double: IterationStats / KvCacheStats
(cpp/tensorrt_llm/nanobind/executor/bindings.cpp; executor/types.h) and the KV cache manager's counts
behind them and behind each request's KvCacheMetrics (kvCacheManager.cpp, evictionPolicy.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class KvCacheStats:
    """Every keyword is an attribute (max/free/used blocks, tokens per block, the alloc/reuse counters)."""

    def __init__(self, **values):
        self.__dict__.update(values)


class IterationStats:
    """``kv_cache_stats`` is a KvCacheStats or None (``std::optional<KvCacheStats>`` in executor/types.h)."""

    def __init__(self, kv_cache_stats):
        self.kv_cache_stats = kv_cache_stats


@dataclass(slots=True)
class KvCacheCounters:
    """The running counts of one executor's KV cache manager, over its whole life.

    Invariants: ``alloc_total == reused_total + missed_total``; ``alloc_new == slots_used <= primary_blocks``
    (a slot is new only the first time it is handed out); counters only grow.
    """

    primary_blocks: int
    reused_total: int = 0
    alloc_total: int = 0
    alloc_new: int = 0
    missed_total: int = 0
    slots_used: int = 0  # pool slots that ever held tokens

    def admit(self, kv: Any, context: int, reused: int) -> None:
        """A request got its sequence (KVCacheManager::addSequence): ``context`` blocks for its prompt,
        ``reused`` of them matched; fills its KvCacheMetrics ``kv`` and counts them."""
        kv.num_total_allocated_blocks, kv.num_reused_blocks = context, reused
        kv.num_missed_blocks = context - reused
        # getFreeBlock (kvCacheManager.cpp): ++mAllocNewBlocks only for a slot whose uniqueTokens are
        # empty, i.e. never used (a block's key is never cleared): at most the pool's size per life
        fresh = min(context - reused, max(0, self.primary_blocks - self.slots_used))
        self.slots_used += fresh
        kv.num_new_allocated_blocks = fresh
        kv.kv_cache_hit_rate = reused / context if context else 0.0
        self.reused_total += reused
        self.alloc_total += context
        self.alloc_new += fresh  # KvCacheStats.alloc_new_blocks is mAllocNewBlocks: the same getFreeBlock rule
        self.missed_total += context - reused

    def stats(self, kv_cache_stats: type[KvCacheStats], blocks_in_use: int, tokens_per_block: int) -> KvCacheStats:
        """A KvCacheStats (of the module's class ``kv_cache_stats``) with ``blocks_in_use`` held by requests."""
        # kvCacheManager.h KvCacheStats (00825c4e): freeNumBlocks = free blocks of the primary pool,
        # usedNumBlocks = maxNumBlocks - freeNumBlocks. evictionPolicy.cpp LRUEvictionPolicy::releaseBlock
        # counts every released block as free (mNumFreeBlocksPerLevel++), the blocks kept in the reuse tree
        # included; claimBlock takes one off. So "used" is what running requests hold, and a cached block
        # is free. The double has no capacity model (it admits everything): used is capped at the pool.
        primary_blocks = self.primary_blocks
        used = min(blocks_in_use, primary_blocks)
        return kv_cache_stats(
            max_num_blocks=primary_blocks, free_num_blocks=primary_blocks - used,
            used_num_blocks=used, tokens_per_block=tokens_per_block,
            alloc_total_blocks=self.alloc_total, alloc_new_blocks=self.alloc_new, reused_blocks=self.reused_total,
            missed_blocks=self.missed_total,
            cache_hit_rate=self.reused_total / self.alloc_total if self.alloc_total else 0.0,
        )
