"""The KV block pool: TensorRT-LLM's V1 KV-manager semantics over two tiers (GPU, host).

One concept per module, lower ones first::

    blocks.py       the slotted block: one physical slot, and a radix-tree node when cached
    free_lists.py   intrusive free lists per priority per tier; their order is the eviction order
    types.py        the API's value types: PoolConfig, Allocation, BlockCopy, PoolError
    events.py       KV cache events (KVCacheEvent) and their replay into a mirror
    stats.py        KvCacheStats-shaped snapshot and the cumulative counters
    recorder.py     the emission of events, counters and per-tenant counts
    tiers.py        the blocks of both tiers and every move: claim, evict (drop/offload), onboard, release, expire
    invariants.py   the whole-pool consistency check the property tests run
    block_pool.py   BlockPool: prefix lookup, check-then-commit allocation, storing finished sequences

Callers import the public names from here (``from retention.pool import BlockPool``).
"""

from retention.pool.block_pool import BlockPool
from retention.pool.types import Allocation, BlockCopy, PoolConfig, PoolError

__all__ = ["Allocation", "BlockCopy", "BlockPool", "PoolConfig", "PoolError"]
