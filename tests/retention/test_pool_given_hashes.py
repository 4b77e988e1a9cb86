"""``BlockPool.allocate(hashes=...)``: a caller's precomputed block hashes change nothing but the work."""

from __future__ import annotations

import random

import pytest

from retention.hashing import block_hashes, chain_hash, chain_hashes, pack_tokens, root_hash
from retention.pool import BlockPool, PoolConfig, PoolError
from retention.types import RetentionPlan, TokenRange

B = 4


def pool() -> BlockPool:
    return BlockPool(PoolConfig(primary_blocks=12, secondary_blocks=10, tokens_per_block=B,
                                secondary_offload_min_priority=30))


def state(p: BlockPool) -> tuple:
    """Everything observable: events, stats, the tree and both tiers' victim order."""
    tree = sorted((h, b.tier, b.slot, b.priority, b.tokens, None if b.parent is None else b.parent.block_hash)
                  for h, b in p.cached_blocks().items())
    return (p.take_events(), p.stats(), tree, [(b.tier, b.slot) for b in p.free_order(0)],
            [(b.tier, b.slot) for b in p.free_order(1)])


@pytest.mark.parametrize("seed", range(6))
def test_given_hashes_replay_exactly_like_the_pools_own(seed: int) -> None:
    rng = random.Random(seed)
    own, given = pool(), pool()
    held: dict[int, list[int]] = {}
    now = 0.0
    for rid in range(300):
        now += rng.choice([0.0, 0.01, 0.5])
        if held and rng.random() < 0.45:
            victim = rng.choice(sorted(held))
            tokens = held.pop(victim)
            store_first = rng.random() < 0.5  # stored at its prefill's end, then released
            for p in (own, given):
                if store_first:
                    p.store(victim, tokens, num_computed_tokens=len(tokens) - 1)
                p.release(victim, tokens, now=now)
            assert state(own) == state(given)
            continue
        # prompts sharing prefixes: 0-3 blocks of one of 4 roots, then a random tail (a partial block or more)
        root, shared = rng.randrange(4), rng.randrange(4)
        tail = [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 9))]
        tokens = [root * 1000 + i for i in range(shared * B)] + tail
        salt = rng.choice([None, None, "s"])
        extra = rng.choice([b"", b"", b"lora-1"])
        plan = RetentionPlan((TokenRange(0, None, rng.choice([10, 35, 60]), rng.choice([None, 200])),), 35, None)
        reserve = rng.choice([0, 2, 6])
        hashes = block_hashes(tokens, B, salt=salt, extra_key=extra)
        a = own.allocate(rid, tokens, salt=salt, tenant="t", plan=plan, now=now, reserve_tokens=reserve,
                         extra_key=extra)
        b = given.allocate(rid, tokens, salt=salt, tenant="t", plan=plan, now=now, reserve_tokens=reserve,
                           extra_key=extra, hashes=hashes)
        assert a == b
        if a is not None:
            held[rid] = tokens
        assert state(own) == state(given)
        given.check_invariants()


def test_given_hashes_are_checked_and_copied() -> None:
    p = pool()
    tokens = list(range(2 * B + 1))
    with pytest.raises(PoolError, match="hashes given"):
        p.allocate("a", tokens, salt=None, tenant=None, now=0, hashes=[1])
    hashes = block_hashes(tokens, B)
    assert p.allocate("a", tokens, salt=None, tenant=None, now=0, hashes=hashes) is not None
    hashes[0] = 0  # the caller's list is not the sequence's
    p.release("a", tokens, now=0)
    assert sorted(p.cached_blocks()) == sorted(block_hashes(tokens, B))


def test_a_given_hash_hit_still_compares_tokens() -> None:
    p = pool()
    first = list(range(2 * B + 1))
    p.allocate("a", first, salt=None, tenant=None, now=0)
    p.release("a", first, now=0)
    other = [t + 100 for t in first]
    # the first prompt's hashes given for other tokens: the tree blocks hold other tokens, no match
    alloc = p.allocate("b", other, salt=None, tenant=None, now=0, hashes=block_hashes(first, B))
    assert alloc is not None and alloc.reused_blocks == 0


def test_chain_hashes_is_chain_hash_down_the_blocks() -> None:
    packed = pack_tokens(list(range(5 * B + 3)))
    for extra in (b"", b"lora-7"):
        expected, h = [], root_hash("x")
        for i in range(5):
            h = chain_hash(h, packed[i * B * 4 : (i + 1) * B * 4], extra)
            expected.append(h)
        assert chain_hashes(packed, B, root_hash("x"), extra) == expected
        assert chain_hashes(packed, B, root_hash("x"), extra, limit=2) == expected[:2]
        assert block_hashes(packed, B, salt="x", extra_key=extra) == expected
