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

    kvCacheManager.cpp (NVIDIA/TensorRT-LLM 002ba6a7, WindowBlockManager): ``++mAllocTotalBlocks`` happens in
    ``getFreeBlock`` only, which a prompt block that misses (``loadOrAllocateBlocks``' no-match branch), a
    partly matched block copied for the request (its ``partialMatch`` branch), an onboard (``onboardBlock``:
    ``auto block = getFreeBlock(); mTransferManager->onboard(...)``) and a generation block
    (``KVCacheManager::addToken`` → ``adjustBlocksIfNeeded`` → ``allocateBlock``, b35ac1b6: one per generation
    step whose slots before it are a multiple of B, the request's last token taking none: allocateKvCache.cpp
    d2b9c97c) each call; a matched block already on the GPU takes none.
    Invariants: ``alloc_total == missed_total + onboarded_total + copied_total + generation_total``;
    with block reuse ``alloc_new == slots_used <= primary_blocks``, without it ``alloc_new == alloc_total``
    (``_get_free_blocks``); counters only grow.
    """

    primary_blocks: int
    block_reuse: bool = True  # the executor's KV cache manager's mEnableBlockReuse, after fixExecutorConfig
    reused_total: int = 0
    alloc_total: int = 0
    alloc_new: int = 0
    missed_total: int = 0
    onboarded_total: int = 0  # not a KvCacheStats field: for tests
    copied_total: int = 0
    generation_total: int = 0
    slots_used: int = 0  # with reuse: pool blocks ever handed out (each has carried a key since)

    def _get_free_blocks(self, count: int) -> int:
        """``count`` calls of ``getFreeBlock`` (kvCacheManager.cpp, NVIDIA/TensorRT-LLM b35ac1b6):
        ``++mAllocTotalBlocks`` each, ``++mAllocNewBlocks`` when the block handed out has no key
        (``block->getUniqueTokens().empty()``). Returns the new ones.

        A key is set only by ``loadOrAllocateBlocks`` (a missed prompt block, a partial copy) and by
        ``storeBlocks`` (``setBlockKey``), and is never cleared. Without block reuse neither runs: the
        no-reuse ``addSequence`` only calls ``allocateBlock``, ``storeContextBlocks`` / ``storeNewBlock`` return
        at ``!mEnableBlockReuse``, and ``removeSequence`` calls ``releaseBlocks`` without the request, so nothing
        is stored: every block is new, for ever (``alloc_new == alloc_total``).

        With reuse (beam width 1, one full-attention window: ``BlockManager::releaseBlocks`` then stores) every
        block a request held carries a key by its release (its misses at ``addSequence``, the rest at
        ``releaseBlocks``' store of the first ``n - 1`` tokens), so a block is new only the first time it
        is handed out. ``LRUEvictionPolicy::initialize`` (evictionPolicy.cpp, 05a91919) queues every block at the default
        priority and ``releaseBlock`` appends a released one behind them, so the never-used blocks go first:
        the first ``primary_blocks`` hand-outs are new, none after. Not modelled (the double keeps no per-block
        priority): a block released with a retention priority below the default sits in a lower queue and is
        handed out before the never-used ones (``getFreeBlock`` scans the queues from the lowest priority)."""
        if not self.block_reuse:
            self.alloc_total += count
            self.alloc_new += count
            return count
        fresh = min(count, max(0, self.primary_blocks - self.slots_used))
        self.slots_used += fresh
        self.alloc_total += count
        self.alloc_new += fresh  # KvCacheStats.alloc_new_blocks is mAllocNewBlocks
        return fresh

    def admit(self, kv: Any, admission: Any) -> None:
        """A request got its sequence (KVCacheManager::addSequence) as ``admission`` (fake_block_manager.
        Admission) and its KvCacheMetrics ``kv`` are filled as the C++ does: the deltas of the manager's
        counters around that one call (``updateAllocTotalBlocksPerRequest(getNumAllocTotalBlocks() -
        numAllocTotalBlocksPreRequest)`` and the same for new / reused / missed), so generation blocks,
        allocated later, are not in the request's figures. TensorRT-LLM's KVCacheManagerTest expects, for a
        second identical request, ``getAllocTotalBlocksPerRequest() == numBlocks - numSharedBlocks``."""
        taken = admission.free_blocks_taken
        fresh = self._get_free_blocks(taken)
        kv.num_total_allocated_blocks, kv.num_new_allocated_blocks = taken, fresh
        kv.num_reused_blocks, kv.num_missed_blocks = admission.reused, admission.missed
        # reused / (reused + missed): KVCacheManagerTest expects numSharedBlocks / numBlocks
        kv.kv_cache_hit_rate = admission.reused / admission.context if admission.context else 0.0
        self.reused_total += admission.reused
        self.missed_total += admission.missed
        self.onboarded_total += admission.onboarded
        self.copied_total += admission.copied

    def generation_block(self) -> None:
        """A generation request's ``addToken`` took a block (``adjustBlocksIfNeeded`` → ``allocateBlock`` →
        ``getFreeBlock``): counted in the pool's ``alloc_total_blocks``, in no request's KvCacheMetrics (those are
        the deltas around ``addSequence`` alone)."""
        self._get_free_blocks(1)
        self.generation_total += 1

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
            # reused / (reused + missed), the ratio ~WindowBlockManager logs as its cache hit rate
            cache_hit_rate=self.reused_total / (self.reused_total + self.missed_total)
            if self.reused_total + self.missed_total else 0.0,
        )
