"""KV event order when a reused host-tier prefix is claimed with a new priority.

``WindowBlockManager::loadOrAllocateBlocks`` (kvCacheManager.cpp) goes block by block: the block's
priority update (``claimBlock``), then ``onboardBlock``, whose ``getFreeBlock`` emits the victim's
offload (or removal) before the block's host -> GPU update; then the next block.
"""

from __future__ import annotations

from retention.pool import BlockPool, PoolConfig
from retention.pool.events import UpdatedEvent
from retention.types import RetentionPlan, TokenRange, Tier

BPT = 4


def test_priority_updates_and_onboarding_interleave_block_by_block():
    pool = BlockPool(PoolConfig(primary_blocks=4, secondary_blocks=8, tokens_per_block=BPT))
    a = list(range(10, 19))  # 9 tokens: blocks 0, 1 full, then a partial one
    pool.allocate("a", a, salt=None, tenant=None, now=0.0)
    pool.release("a", a, now=0.0)
    for k in range(2):  # push a's blocks to the host tier
        other = [100 * (k + 1) + j for j in range(13)]
        pool.allocate(f"o{k}", other, salt=None, tenant=None, now=1.0)
        pool.release(f"o{k}", other, now=1.0)
    assert pool.lookup(a, salt=None) == (2, 0, 2)
    by_tokens = {b.tokens: b for b in pool.cached_blocks().values()}
    block0, block1 = (by_tokens[b"".join(t.to_bytes(4, "little") for t in a[i * BPT:(i + 1) * BPT])] for i in (0, 1))
    pool.take_events()
    pool.allocate("b", a, salt=None, tenant=None, plan=RetentionPlan((TokenRange(0, None, 80, None),), 35, None), now=2.0)
    seen = []
    for event in pool.take_events():
        assert isinstance(event, UpdatedEvent)
        if event.priority:
            seen.append(("priority", event.block_hash))
        elif event.cache_level == (Tier.SECONDARY, Tier.PRIMARY):
            seen.append(("onboard", event.block_hash))
        else:
            seen.append(("offload", "victim"))
    assert seen == [
        ("priority", block0.block_hash), ("onboard", block0.block_hash),
        ("priority", block1.block_hash), ("offload", "victim"), ("onboard", block1.block_hash),
        ("offload", "victim"),  # the new third block's victim
    ]
