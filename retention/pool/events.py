"""KV cache events, shaped like TensorRT-LLM's ``KVCacheEvent``.

``cpp/include/tensorrt_llm/executor/executor.h`` defines ``KVCacheEvent`` with an
``eventId`` and one of ``KVCacheCreatedData`` (blocks per cache level),
``KVCacheStoredData`` (``parentHash`` + stored blocks: ``blockHash``, ``tokens``,
``cacheLevel``, ``priority``), ``KVCacheRemovedData`` (``blockHashes``) and
``KVCacheUpdatedData`` (``blockHash`` + optional ``cacheLevel``/``priority`` diffs
old→new). The pool enqueues them where TensorRT-LLM's ``WindowBlockManager`` calls
``mEventManager->enqueue*Event`` (``kvCacheManager.cpp``: ``storeBlocks``,
``freeChildren``, ``getFreeBlock``, ``onboardBlock``, ``loadOrAllocateBlocks``).

kvgate addition: a priority update is also emitted when a duration expires (TensorRT-LLM's
``LRUEvictionPolicy::refresh`` changes the priority silently), so that replaying the
stream rebuilds every block's tier *and* priority.

Invariant: applying the drained events in order to an empty mirror reproduces the pool's
radix tree exactly (tests/retention/test_pool_properties.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.types import Tier


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: int
    tokens: tuple[int, ...]
    cache_level: Tier
    priority: int


@dataclass(frozen=True, slots=True)
class CreatedEvent:
    event_id: int
    num_blocks_per_cache_level: tuple[int, int]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """``blocks`` form a chain: blocks[0]'s parent is ``parent_hash`` (None = root)."""

    event_id: int
    parent_hash: int | None
    blocks: tuple[StoredBlock, ...]


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    event_id: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class UpdatedEvent:
    """``cache_level`` / ``priority`` are ``(old, new)`` pairs, or None when unchanged."""

    event_id: int
    block_hash: int
    cache_level: tuple[Tier, Tier] | None = None
    priority: tuple[int, int] | None = None


KvEvent = CreatedEvent | StoredEvent | RemovedEvent | UpdatedEvent


@dataclass(slots=True)
class MirrorNode:
    parent: int | None
    tier: Tier
    priority: int


def replay(events: list[KvEvent], mirror: dict[int, MirrorNode] | None = None) -> dict[int, MirrorNode]:
    """Apply events to ``mirror`` (block hash -> node); what an event consumer would keep."""
    tree = {} if mirror is None else mirror
    for event in events:
        if isinstance(event, StoredEvent):
            parent = event.parent_hash
            for block in event.blocks:
                tree[block.block_hash] = MirrorNode(parent, block.cache_level, block.priority)
                parent = block.block_hash
        elif isinstance(event, RemovedEvent):
            for block_hash in event.block_hashes:
                tree.pop(block_hash, None)
        elif isinstance(event, UpdatedEvent):
            node = tree.get(event.block_hash)
            if node is None:
                continue
            if event.cache_level is not None:
                node.tier = event.cache_level[1]
            if event.priority is not None:
                node.priority = event.priority[1]
    return tree
