"""The pool-wide ``alloc_new_blocks`` the reference engine reports, as TensorRT-LLM counts ``allocNewBlocks``.

``WindowBlockManager::getFreeBlock`` (kvCacheManager.cpp) counts a block as new only if
``block->getUniqueTokens().empty()``: it never held a block key. A block gets a key when it is
allocated for the prompt's first n - 1 tokens (``loadOrAllocateBlocks``, partial block included) or
stored, and a freed block keeps it, so on a warm pool the count stops growing.
"""

from __future__ import annotations

from retention.pool import BlockPool, PoolConfig

BPT = 4


def test_alloc_new_stops_growing_once_every_block_held_a_key():
    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=BPT))
    for i in range(50):
        prompt = [1000 + 10 * i + j for j in range(6)]  # 2 blocks, the last one partial (keyed all the same)
        pool.allocate(i, prompt, salt=None, tenant=None, now=float(i))
        pool.extend(i, 8, now=float(i))
        pool.release(i, prompt + [7, 7], now=float(i))  # stores block 0; block 1 is freed with its key
    stats = pool.stats()
    assert (stats.alloc_total_blocks, stats.missed_blocks) == (100, 100)
    assert stats.alloc_new_blocks == 8  # each of the 8 slots once


def test_which_blocks_get_a_key_and_keep_it():
    """Prompt blocks holding some of the first n - 1 tokens get a key at allocation (the block holding
    only the last prompt token does not: ``chopVectorIntoBlocks`` of n - 1 tokens); a decode block only
    when stored; a freed block keeps it, so the next ``getFreeBlock`` of it is not new."""
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=BPT))
    prompt = list(range(10, 10 + BPT + 1))  # n - 1 = 4 tokens: block 0 keyed, block 1 (last token) not
    pool.allocate("r", prompt, salt=None, tenant=None, now=0.0)
    slots, _ = pool.extend("r", 3 * BPT, now=0.0)  # block 2: decode only
    by_slot = {b.slot: b for b in pool.all_blocks() if b.tier == 0}
    assert [by_slot[s].keyed for s in slots] == [True, False, False]
    pool.release("r", prompt + [7] * 4, now=0.0)  # 8 of 9 tokens computed: stores blocks 0, 1; block 2 freed key-less
    assert [by_slot[s].keyed for s in slots] == [True, True, False]
    assert by_slot[slots[2]].block_hash is None and pool.stats().alloc_new_blocks == 3
    pool.allocate("s", [99] * (4 * BPT), salt=None, tenant=None, now=1.0)  # takes all 4 slots
    stats = pool.stats()
    assert stats.alloc_total_blocks == 7
    assert stats.alloc_new_blocks == 3 + 2  # the never-used slot and the decode-only block; not blocks 0, 1
