"""Pool statistics, shaped like TensorRT-LLM's ``KvCacheStats`` plus tier traffic.

``KvCacheStats`` (``cpp/include/tensorrt_llm/batch_manager/kvCacheManager.h``):
``maxNumBlocks``, ``freeNumBlocks``, ``usedNumBlocks``, ``toksPerBlock``,
``allocTotalBlocks``, ``allocNewBlocks``, ``reusedBlocks``, ``missedBlocks``,
``cacheHitRate`` (= reused / (reused + missed)). Counting follows
``WindowBlockManager::getFreeBlock`` / ``loadOrAllocateBlocks`` (``kvCacheManager.cpp``):
every block handed out counts in ``alloc_total``; one that never held tokens also in
``alloc_new``; every matched block is ``reused``, every unmatched prompt block ``missed``.

kvgate adds per-tier counts (free/used, offloaded, onboarded, evicted) and reuse split by
the tier the hit came from. Counters are cumulative; the pool only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolCounters:
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    reused_primary_blocks: int = 0
    reused_secondary_blocks: int = 0
    missed_blocks: int = 0
    offloaded_blocks: int = 0  # primary -> secondary copies
    onboarded_blocks: int = 0  # secondary -> primary copies
    evicted_primary_blocks: int = 0  # cached primary blocks dropped (not offloaded)
    evicted_secondary_blocks: int = 0  # cached host blocks dropped
    expired_blocks: int = 0  # durations that ran out (priority fell back to 35)


@dataclass(frozen=True, slots=True)
class PoolStats:
    tokens_per_block: int
    max_num_blocks: int  # primary tier
    free_num_blocks: int
    used_num_blocks: int
    secondary_max_blocks: int
    secondary_free_blocks: int
    secondary_used_blocks: int  # host blocks holding cached KV
    cached_primary_blocks: int  # primary blocks in the radix tree (in use or free)
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    reused_primary_blocks: int
    reused_secondary_blocks: int
    missed_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    evicted_primary_blocks: int
    evicted_secondary_blocks: int
    expired_blocks: int

    @property
    def cache_hit_rate(self) -> float:
        total = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / total if total else 0.0

    @property
    def evicted_blocks(self) -> int:
        return self.evicted_primary_blocks + self.evicted_secondary_blocks
