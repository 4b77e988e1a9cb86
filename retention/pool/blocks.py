"""The slotted KV block: one physical slot of one tier, and (when cached) a radix-tree node.

Mirrors TensorRT-LLM's ``KVCacheBlock`` (``cpp/include/tensorrt_llm/batch_manager/
kvCacheManager.h``; methods in ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``):
there is one block object per physical slot of each tier, created once. Offloading a
block to the host tier swaps the *slots* of two block objects
(``KVCacheBlock::swapMemoryPoolBlockOffset``) so the tree node keeps its identity while
its KV moves; the block object that received the GPU slot is the one handed out.

A block is in exactly one of these states::

    EMPTY    ref_count == 0, not in the tree, in its tier's empty list
    CACHED   ref_count == 0, in the tree, evictable once it is a leaf of its tier
    IN USE   ref_count  > 0 (primary tier only), maybe in the tree

Invariants (checked by ``BlockPool.check_invariants``):

* ``in_tree`` ⇔ ``block_hash is not None``; a tree block's ``parent`` is ``None`` only at
  the (implicit, salted) root level;
* a secondary-tier block is never referenced and all of its tree children are
  secondary too, so the primary blocks of any chain form a prefix of it;
* ``free_list is not None`` ⇔ the block is EMPTY, or CACHED and has no child in its own
  tier (a "free leaf"); only such blocks are ever chosen as victims.

``__slots__`` keeps a block at ~200 bytes and no ``__dict__`` (a test asserts it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retention.types import DEFAULT_PRIORITY, Tier


@dataclass(slots=True, eq=False)
class Block:
    tier: Tier
    slot: int
    # Radix-tree identity (None while EMPTY or in use but not yet stored).
    block_hash: int | None = None
    tokens: bytes | None = None  # the block's token ids (int32 little-endian), compared on a hash hit
    parent: Block | None = None
    children: dict[int, Block] | None = None  # child hash -> child, created lazily
    num_primary_children: int = 0  # children currently in the primary tier (leaf test for tier 0)
    # Retention (``KVCacheBlock::mPriority`` / ``mDurationMs`` / ``mExpirationTime``).
    priority: int = DEFAULT_PRIORITY
    duration_ms: int | None = None
    expires_at: float | None = None  # seconds, same clock as the ``now`` callers pass in
    ref_count: int = 0
    tenant: str | None = None  # who stored it (for per-tenant block counts)
    # Free-list membership: intrusive links plus the list and a release sequence number.
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    free_list: object | None = field(default=None, repr=False)
    release_seq: int = 0  # larger = released more recently; LRU order inside a priority
    # Ever held a block key (``KVCacheBlock::mBlockKey``): set when the block is allocated for
    # prompt tokens or stored, never cleared (TensorRT-LLM keeps a freed block's key), so
    # ``getFreeBlock`` counts it in ``allocNewBlocks`` only while it is False.
    keyed: bool = False

    @property
    def in_tree(self) -> bool:
        return self.block_hash is not None

    def is_tier_leaf(self) -> bool:
        """No child in this block's own tier (host blocks only ever have host children)."""
        if self.tier is Tier.PRIMARY:
            return self.num_primary_children == 0
        return not self.children

    def descendants(self) -> list[Block]:
        """All tree descendants, children before grandchildren (iterative: chains can be long)."""
        out: list[Block] = []
        stack = list(self.children.values()) if self.children else []
        while stack:
            node = stack.pop()
            out.append(node)
            if node.children:
                stack.extend(node.children.values())
        return out
