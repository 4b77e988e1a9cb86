"""Whole-pool consistency check for tests: O(pool size), never called on the hot path.

Checks the invariants ``BlockPool`` and ``Tiers`` document: free lists hold exactly the empty blocks and
the unreferenced tier-leaves of the tree, each tier's slots are a permutation of
``0..capacity-1`` (capacity never exceeded), host blocks are never referenced and never
have GPU children, every tree block is reachable from the root, reference counts never
grow along a chain, and the free-block counter matches.
"""

from __future__ import annotations

from retention.pool.tiers import Tiers
from retention.pool.types import PoolConfig
from retention.types import Tier

P, S = Tier.PRIMARY, Tier.SECONDARY


def check_pool_invariants(tiers: Tiers, config: PoolConfig) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``tiers`` (shaped by ``config``)."""
    listed: set[int] = set()
    for tier in (P, S):
        total = 0
        for block in tiers.free[tier].victim_order():
            assert block.tier == tier, "block in the wrong tier's list"
            assert block.ref_count == 0, "free block is referenced"
            assert id(block) not in listed
            listed.add(id(block))
            total += 1
        assert total == tiers.free[tier].size
    free_primary = 0
    for tier in (P, S):
        slots = sorted(b.slot for b in tiers.blocks[0] + tiers.blocks[1] if b.tier == tier)
        capacity = config.primary_blocks if tier == P else config.secondary_blocks
        assert slots == list(range(capacity)), f"tier {tier} slots are not a permutation"
    for block in tiers.blocks[0] + tiers.blocks[1]:
        if block.tier == P and block.ref_count == 0:
            free_primary += 1
        if block.tier == S:
            assert block.ref_count == 0, "host block is referenced"
        if not block.in_tree:
            assert block.ref_count > 0 or id(block) in listed, "empty block missing from the empty list"
            continue
        assert tiers.cached[block.block_hash] is block  # type: ignore[index]
        node = block
        while node.parent is not None:  # reachable from the root
            assert node.parent.children and node.parent.children[node.block_hash] is node  # type: ignore[index]
            node = node.parent
        if block.tier == S:
            assert all(c.tier == S for c in (block.children or {}).values()), "GPU child below a host block"
        primary_children = sum(1 for c in (block.children or {}).values() if c.tier == P)
        assert primary_children == block.num_primary_children
        evictable = block.ref_count == 0 and block.is_tier_leaf()
        assert evictable == (id(block) in listed), "free-leaf membership is wrong"
        if block.ref_count:
            assert all(c.ref_count <= block.ref_count for c in (block.children or {}).values())
    assert free_primary == tiers.num_free_primary
    assert len(tiers.cached) == sum(1 for b in tiers.blocks[0] + tiers.blocks[1] if b.in_tree)
