"""The pool's blocks in their two tiers, and every move of a block between states.

vLLM v1 splits its ``BlockPool`` (the blocks, the free queue, the hash map) from its
``KVCacheManager`` (what a request gets); kvgate does the same: this module owns the block
objects of both tiers, their free lists (whose order *is* the eviction order, see
``free_lists.py``), the hash → tree-block map and the expiry heap, and performs the moves
TensorRT-LLM's ``WindowBlockManager`` and ``LRUEvictionPolicy`` make
(``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``, ``evictionPolicy.cpp``)::

    claim      free/cached block -> IN USE         (LRUEvictionPolicy::claimBlock)
    take       victim -> EMPTY primary, either     (WindowBlockManager::getFreeBlock)
                 offloaded: its node moves to a host slot (copy GPU -> host, swap slots)
                 dropped:   it and its host descendants leave the tree (freeChildren)
    onboard    host node -> primary slot           (WindowBlockManager::onboardBlock)
    release    IN USE -> CACHED / EMPTY, leaf first (releaseBlocks)
    expire     a free block's duration ran out -> priority 35 (LRUEvictionPolicy::refresh)

``block_pool.py`` decides *which* blocks a request needs; this module never looks at
tokens beyond the ones a tree node carries.

Invariants (``invariants.py`` checks them): each tier's free lists hold exactly its EMPTY
blocks and its unreferenced tier-leaves; ``num_free_primary`` counts the primary blocks
with ``ref_count == 0``; ``cached`` maps each tree block's hash to it; a host block is never
referenced and has only host children; ``release_seq`` grows with every release, so it
orders each priority's list least recently released first.
"""

from __future__ import annotations

import heapq

from retention.pool.blocks import Block
from retention.pool.events import RemovedEvent, UpdatedEvent
from retention.pool.free_lists import TierFreeLists
from retention.pool.recorder import PoolRecorder
from retention.pool.types import BlockCopy, PoolConfig
from retention.types import DEFAULT_PRIORITY, Tier

P, S = Tier.PRIMARY, Tier.SECONDARY


class Tiers:
    """Blocks of both tiers, their free lists, the tree's hash map, and the moves between states."""

    __slots__ = (
        "blocks", "free", "cached", "num_free_primary",
        "_rec", "_offload_min", "_has_host", "_release_counter", "_expiry", "_expiry_counter",
    )

    def __init__(self, config: PoolConfig, recorder: PoolRecorder) -> None:
        self.blocks: tuple[list[Block], list[Block]] = (
            [Block(P, i) for i in range(config.primary_blocks)],
            [Block(S, i) for i in range(config.secondary_blocks)],
        )
        self.free = (TierFreeLists(), TierFreeLists())
        for tier in (P, S):
            for block in self.blocks[tier]:
                self.free[tier].add_empty(block)
        self.num_free_primary = config.primary_blocks  # blocks with ref_count == 0
        self.cached: dict[int, Block] = {}
        self._rec = recorder
        self._offload_min = config.secondary_offload_min_priority
        self._has_host = config.secondary_blocks > 0
        self._release_counter = 0
        self._expiry: list[tuple[float, int, Block]] = []
        self._expiry_counter = 0

    # ------------------------------------------------------------------ claiming
    def claim_reused(self, block: Block, rng: tuple[int, int | None] | None) -> int | None:
        """``LRUEvictionPolicy::claimBlock`` for a matched block: override priority, replace duration.

        Returns the old priority when it changed (the caller emits the priority update in
        ``loadOrAllocateBlocks``' order), else ``None``.
        """
        old = None
        if block.free_list is not None:
            self.free[block.tier].remove(block)
        if block.tier == P and block.ref_count == 0:
            self.num_free_primary -= 1
        if rng is not None and rng[0] != block.priority:
            old = block.priority
            block.priority = rng[0]
        block.duration_ms = None if rng is None else rng[1]
        block.expires_at = None
        # Host blocks are referenced too until onboarded, so no victim search in this
        # call can treat them (or their ancestors) as free.
        block.ref_count += 1
        return old

    def adopt(self, block: Block) -> None:
        """Take one more reference on a primary tree block (a stored twin a sequence switches to)."""
        if block.free_list is not None:
            self.free[P].remove(block)
        if block.ref_count == 0:
            self.num_free_primary -= 1
        block.ref_count += 1

    def take_new(self, priority: int, duration: int | None, tenant: str | None, copies: list[BlockCopy]) -> Block:
        """An IN USE primary block with the given retention, owned by ``tenant``."""
        block = self.take_primary(copies)
        block.priority = priority
        block.duration_ms = duration
        block.ref_count = 1
        block.tenant = tenant
        self._rec.count(block, P, +1)
        return block

    def take_primary(self, copies: list[BlockCopy]) -> Block:
        """``WindowBlockManager::getFreeBlock``: an empty GPU block, offloading or dropping a victim.

        Returns an EMPTY primary block outside every list (the caller claims it). The
        victim is offloaded iff it holds tokens, its priority is at or above the offload
        threshold and a host block can be freed; otherwise it is dropped with its subtree.
        """
        victim = self.free[P].pop_victim()
        assert victim is not None, "caller checked room"
        self.num_free_primary -= 1
        counters = self._rec.counters
        counters.alloc_total_blocks += 1
        if not victim.keyed:  # ``getFreeBlock``: ``getUniqueTokens().empty()``, keys are never cleared
            counters.alloc_new_blocks += 1
        if victim.block_hash is None:
            return victim
        host = None
        if victim.priority >= self._offload_min and self._has_host:
            # The host victim may be the victim's own child; the temporary reference keeps
            # the victim from being re-listed as a GPU leaf when that child is detached.
            victim.ref_count = 1
            host = self._take_host()
            victim.ref_count = 0
        if host is None:
            self._drop_subtree(victim)
            counters.evicted_primary_blocks += 1
            return victim
        self._offload(victim, host, copies)
        return host

    def onboard(self, block: Block, copies: list[BlockCopy]) -> None:
        """``WindowBlockManager::onboardBlock``: copy a host block into a free GPU slot, swap slots."""
        target = self.take_primary(copies)
        copies.append(BlockCopy(S, block.slot, P, target.slot))
        host_slot = block.slot
        block.tier, block.slot = P, target.slot
        target.tier, target.slot = S, host_slot
        self.free[S].add_empty(target)
        if block.parent is not None and block.parent.tier == P:
            block.parent.num_primary_children += 1
        rec = self._rec
        rec.count(block, S, -1)
        rec.count(block, P, +1)
        rec.counters.onboarded_blocks += 1
        if rec.events_on:
            rec.emit(lambda i: UpdatedEvent(i, block.block_hash, cache_level=(S, P)))  # type: ignore[arg-type]

    def _offload(self, victim: Block, host: Block, copies: list[BlockCopy]) -> None:
        """Copy ``victim``'s KV out to ``host``'s slot, then swap slots: the tree node moves to the host tier."""
        gpu_slot = victim.slot
        copies.append(BlockCopy(P, gpu_slot, S, host.slot))
        victim.tier, victim.slot = S, host.slot
        host.tier, host.slot = P, gpu_slot
        victim.duration_ms = None  # offload keeps the priority, clears the duration
        victim.expires_at = None
        rec = self._rec
        rec.moved_to_host(victim)
        rec.counters.offloaded_blocks += 1
        if rec.events_on:
            rec.emit(lambda i: UpdatedEvent(i, victim.block_hash, cache_level=(P, S)))  # type: ignore[arg-type]
        parent = victim.parent
        if parent is not None:
            parent.num_primary_children -= 1
            if parent.num_primary_children == 0 and parent.ref_count == 0 and parent.free_list is None:
                self.free[P].add_cached(parent, ordered=True)
        self._release_counter += 1
        victim.release_seq = self._release_counter
        if not victim.children:
            self.free[S].add_cached(victim, ordered=False)

    def _take_host(self) -> Block | None:
        """A free host block (host priority then LRU, whatever the incoming block), emptied."""
        victim = self.free[S].pop_victim()
        if victim is None:
            return None
        if victim.block_hash is not None:
            victim_hash = victim.block_hash
            self.detach(victim, relink_parent=True)
            if self._rec.events_on:
                self._rec.emit(lambda i: RemovedEvent(i, (victim_hash,)))
            self._rec.counters.evicted_secondary_blocks += 1
        return victim

    # ------------------------------------------------------------------ tree removal
    def _drop_subtree(self, victim: Block) -> None:
        """Remove a dropped GPU victim and its (host) descendants from the tree (``freeChildren``)."""
        rec = self._rec
        if not victim.children:  # the common case: a plain leaf
            victim_hash = victim.block_hash
            self.detach(victim, relink_parent=True)
            if rec.events_on:
                rec.emit(lambda i: RemovedEvent(i, (victim_hash,)))  # type: ignore[arg-type]
            return
        removed: list[int] = []
        for node in reversed(victim.descendants()):
            if node.free_list is not None:
                self.free[S].remove(node)
            removed.append(node.block_hash)  # type: ignore[arg-type]
            self.detach(node, relink_parent=False)
            self.free[S].add_empty(node)
            rec.counters.evicted_secondary_blocks += 1
        removed.append(victim.block_hash)  # type: ignore[arg-type]
        self.detach(victim, relink_parent=True)
        if rec.events_on:
            rec.emit(lambda i: RemovedEvent(i, tuple(removed)))

    def detach(self, block: Block, *, relink_parent: bool) -> None:
        """Take a childless block out of the tree; it becomes content-free."""
        parent = block.parent
        del self.cached[block.block_hash]  # type: ignore[arg-type]
        if parent is not None:
            del parent.children[block.block_hash]  # type: ignore[index, arg-type]
            if block.tier == P:
                parent.num_primary_children -= 1
            if relink_parent and parent.ref_count == 0 and parent.free_list is None and parent.is_tier_leaf():
                self.free[parent.tier].add_cached(parent, ordered=True)
        if block.tenant is not None:
            self._rec.count(block, block.tier, -1)
            block.tenant = None
        block.block_hash = None
        block.tokens = None
        block.parent = None
        block.children = None
        block.priority = DEFAULT_PRIORITY
        block.duration_ms = None
        block.expires_at = None

    # ------------------------------------------------------------------ release, expiry
    def release_refs(self, blocks: list[Block], now: float) -> None:
        """Drop one reference per block, leaf first (``releaseBlocks`` walks in reverse).

        A block left unreferenced becomes EMPTY (no tree node) or CACHED; a cached block
        with a duration and a priority other than 35 expires at ``now + duration``.
        """
        free = self.free[P]
        rec = self._rec
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count:
                continue
            self.num_free_primary += 1
            if block.block_hash is None:
                rec.count(block, P, -1)
                block.tenant = None
                block.priority = DEFAULT_PRIORITY
                block.duration_ms = None
                block.expires_at = None
                free.add_empty(block)
                continue
            self._release_counter += 1
            block.release_seq = self._release_counter
            if block.duration_ms is not None and block.priority != DEFAULT_PRIORITY:
                block.expires_at = now + block.duration_ms / 1000.0
                self._expiry_counter += 1
                heapq.heappush(self._expiry, (block.expires_at, self._expiry_counter, block))
            if block.num_primary_children == 0:
                free.add_cached(block, ordered=False)

    def refresh(self, now: float) -> None:
        """``LRUEvictionPolicy::refresh``: free blocks whose duration ran out return to priority 35."""
        heap = self._expiry
        rec = self._rec
        while heap and heap[0][0] <= now:
            expires_at, _, block = heapq.heappop(heap)
            if block.expires_at != expires_at or block.ref_count or not block.in_tree or block.tier != P:
                continue  # stale entry: the block was reused, moved or dropped since
            in_list = block.free_list is not None
            if in_list:
                self.free[P].remove(block)
            old = block.priority
            block.priority = DEFAULT_PRIORITY
            block.duration_ms = None
            block.expires_at = None
            self._release_counter += 1
            block.release_seq = self._release_counter
            if in_list:
                self.free[P].add_cached(block, ordered=False)
            rec.counters.expired_blocks += 1
            if old != DEFAULT_PRIORITY:
                rec.emit(lambda i: UpdatedEvent(i, block.block_hash, priority=(old, DEFAULT_PRIORITY)))  # type: ignore[arg-type]
