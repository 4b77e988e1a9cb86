"""One scenario per documented pool behaviour (DESIGN §4, retention/pool/block_pool.py docstring)."""

from __future__ import annotations

import hashlib

import pytest

import retention.hashing as hashing_module
import retention.pool.block_pool as pool_module
from retention.pool.events import RemovedEvent, StoredEvent, UpdatedEvent, replay
from retention.pool import BlockCopy, BlockPool, PoolConfig, PoolError
from retention.types import DEFAULT_PLAN, RetentionPlan, Tier, TokenRange

B = 4  # tokens per block
P, S = Tier.PRIMARY, Tier.SECONDARY


def toks(base: int, blocks: int, extra: int = 1) -> list[int]:
    """``blocks`` full blocks of distinct tokens starting at ``base`` plus ``extra`` tokens."""
    return list(range(base, base + blocks * B + extra))


def plan(priority: int, duration_ms: int | None = None, decode: int = 35, decode_ms: int | None = None) -> RetentionPlan:
    return RetentionPlan((TokenRange(0, None, priority, duration_ms),), decode, decode_ms)


def run(pool: BlockPool, rid, tokens, *, p: RetentionPlan = DEFAULT_PLAN, now: float = 0.0, salt=None, tenant="t"):
    """Allocate then release immediately (prompt fully computed)."""
    alloc = pool.allocate(rid, tokens, salt=salt, tenant=tenant, plan=p, now=now)
    assert alloc is not None
    pool.release(rid, tokens, now=now, num_computed_tokens=len(tokens))
    pool.check_invariants()
    return alloc


def where(pool: BlockPool, tokens, salt=None) -> tuple[int, int, int]:
    return pool.lookup(tokens + [0], salt=salt)


@pytest.mark.parametrize(
    ("threshold", "priority", "offloaded"),
    [(30, 29, False), (30, 30, True), (30, 35, True), (35, 30, False), (35, 34, False), (35, 35, True)],
)
def test_offload_or_drop_around_threshold(threshold: int, priority: int, offloaded: bool) -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=2, tokens_per_block=B, secondary_offload_min_priority=threshold))
    first = toks(0, 2, extra=0)
    run(pool, "a", first, p=plan(priority))
    assert where(pool, first) == (2, 2, 0)
    run(pool, "b", toks(100, 2, extra=0), p=plan(90))  # needs both GPU blocks
    stats = pool.stats()
    if offloaded:
        assert where(pool, first) == (2, 0, 2)
        assert stats.offloaded_blocks == 2 and stats.evicted_primary_blocks == 0
    else:
        assert where(pool, first) == (0, 0, 0)
        assert stats.offloaded_blocks == 0 and stats.evicted_primary_blocks == 2


def test_no_host_tier_means_drop_even_above_threshold() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 0), p=plan(100))
    run(pool, "b", toks(50, 2, 0))
    assert where(pool, toks(0, 2, 0)) == (0, 0, 0)


def test_offload_keeps_priority_and_clears_duration() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=1, secondary_blocks=1, tokens_per_block=B))
    run(pool, "a", toks(0, 1, 0), p=plan(60, duration_ms=5_000))
    run(pool, "b", toks(10, 1, 0), p=plan(90))
    (block,) = [b for b in pool.cached_blocks().values() if b.tier == S]
    assert (block.priority, block.duration_ms, block.expires_at) == (60, None, None)


def test_duration_expiry_returns_block_to_default_priority() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, tokens_per_block=B))
    keep = toks(0, 1, 0)
    run(pool, "keep", keep, p=plan(80, duration_ms=1_000), now=0.0)  # expires at t=1.0
    run(pool, "plain", toks(20, 1, 0), now=0.5)  # priority 35, released after 'keep'
    pool.take_events()
    # Before expiry the 35 block is the victim; the 80 block survives.
    run(pool, "x", toks(40, 1, 0), p=plan(90), now=0.9)
    assert where(pool, keep) == (1, 1, 0)
    assert where(pool, toks(20, 1, 0)) == (0, 0, 0)
    # After expiry 'keep' is back at 35, below 'x' (90): it is the next victim.
    run(pool, "y", toks(60, 1, 0), p=plan(90), now=2.0)
    assert where(pool, keep) == (0, 0, 0)
    events = pool.take_events()
    assert any(isinstance(e, UpdatedEvent) and e.priority == (80, 35) for e in events)
    assert pool.stats().expired_blocks == 1


def test_duration_does_not_run_while_the_block_is_in_use() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B))
    tokens = toks(0, 1, 0)
    run(pool, "a", tokens, p=plan(80, duration_ms=1_000), now=0.0)
    # Reused at t=0.5 with the same plan: the duration restarts at the *release* (t=10).
    assert pool.allocate("b", tokens + [7], salt=None, tenant="t", plan=plan(80, 1_000), now=0.5) is not None
    pool.release("b", tokens + [7], now=10.0)
    (block,) = pool.cached_blocks().values()
    assert block.expires_at == pytest.approx(11.0)
    pool.allocate("c", toks(30, 1, 0), salt=None, tenant="t", plan=DEFAULT_PLAN, now=10.5)
    assert block.priority == 80  # not yet expired


def test_onboarding_copies_host_block_back_and_reports_it() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=3, secondary_blocks=2, tokens_per_block=B))
    prompt = toks(0, 2, 0)
    run(pool, "a", prompt)
    run(pool, "b", toks(100, 3, 0))  # pushes 'a' to host
    assert where(pool, prompt) == (2, 0, 2)
    pool.take_events()
    alloc = pool.allocate("c", prompt + [1], salt=None, tenant="t", plan=DEFAULT_PLAN, now=1.0)
    assert alloc is not None
    assert (alloc.reused_blocks, alloc.onboarded_blocks, alloc.new_blocks) == (2, 2, 1)
    assert alloc.num_cached_tokens == 2 * B
    onboards = [c for c in alloc.copies if c.src_tier == S]
    assert [c.dst_slot for c in onboards] == list(alloc.slots[:2])
    # Copies are safe in list order: no slot is read after an earlier copy wrote it.
    written: set[tuple[Tier, int]] = set()
    for copy in alloc.copies:
        assert (copy.src_tier, copy.src_slot) not in written
        written.add((copy.dst_tier, copy.dst_slot))
    assert pool.stats().onboarded_blocks == 2
    assert sum(1 for e in pool.take_events() if isinstance(e, UpdatedEvent) and e.cache_level == (S, P)) == 2


def test_onboarding_may_offload_another_block() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=2, tokens_per_block=B))
    run(pool, "a", toks(0, 1, 0))
    run(pool, "b", toks(100, 2, 0))  # 'a' -> host; GPU holds b0, b1
    alloc = pool.allocate("c", toks(0, 1, 1), salt=None, tenant="t", plan=DEFAULT_PLAN, now=1.0)
    assert alloc is not None and alloc.onboarded_blocks == 1
    assert BlockCopy(P, alloc.slots[0], S, alloc.copies[1].src_slot) != alloc.copies[0]
    assert alloc.copies[0].src_tier == P and alloc.copies[0].dst_tier == S  # offload first
    assert alloc.copies[1] == BlockCopy(S, alloc.copies[1].src_slot, P, alloc.copies[0].src_slot)


def test_host_victim_is_lowest_host_priority_regardless_of_incoming() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=1, secondary_blocks=2, tokens_per_block=B))
    run(pool, "low", toks(0, 1, 0), p=plan(40))
    run(pool, "high", toks(10, 1, 0), p=plan(90))  # low -> host
    run(pool, "mid", toks(20, 1, 0), p=plan(50))  # high -> host
    run(pool, "x", toks(30, 1, 0), p=plan(50))  # mid (50) -> host, evicting 'low' (40) from host
    assert where(pool, toks(0, 1, 0)) == (0, 0, 0)
    assert where(pool, toks(10, 1, 0)) == (1, 0, 1)
    assert where(pool, toks(20, 1, 0)) == (1, 0, 1)
    run(pool, "y", toks(40, 1, 0), p=plan(30))  # incoming 30 still evicts host 'mid' (50 < 90)
    assert where(pool, toks(20, 1, 0)) == (0, 0, 0)
    assert where(pool, toks(30, 1, 0)) == (1, 0, 1)


def test_dropped_victim_takes_its_host_descendants_along() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=1, tokens_per_block=B))
    chain = toks(0, 2, 0)
    # Parent below the threshold, child above it.
    run(pool, "a", chain, p=RetentionPlan((TokenRange(0, B, 10), TokenRange(B, None, 90))))
    run(pool, "b", toks(100, 1, 0), p=plan(95))  # child (90) is the only GPU leaf -> host
    assert where(pool, chain) == (2, 1, 1)
    pool.take_events()
    run(pool, "c", toks(200, 1, 0), p=plan(95))  # parent (10) dropped; its host child with it
    assert where(pool, chain) == (0, 0, 0)
    removed = [e for e in pool.take_events() if isinstance(e, RemovedEvent)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2


def test_only_leaves_are_evicted_even_when_parent_priority_is_lower() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=3, tokens_per_block=B))
    chain = toks(0, 2, 0)
    run(pool, "a", chain, p=RetentionPlan((TokenRange(0, B, 5), TokenRange(B, None, 90))))
    run(pool, "b", toks(100, 1, 0), p=plan(50))
    run(pool, "c", toks(200, 1, 0), p=plan(50))  # victim: b (50); the parent at 5 is not a leaf
    assert where(pool, chain) == (2, 2, 0)
    assert where(pool, toks(100, 1, 0)) == (0, 0, 0)


def test_explicit_priority_on_reuse_overrides_and_uncovered_reuse_keeps_it() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B))
    prompt = toks(0, 2, 0)
    run(pool, "a", prompt, p=plan(80))
    pool.take_events()
    # Range covers block 0 only; block 1 is uncovered and keeps 80.
    run(pool, "b", prompt + [5], p=RetentionPlan((TokenRange(0, B, 10),)))
    by_depth = sorted(pool.cached_blocks().values(), key=lambda b: b.parent is not None)
    assert [b.priority for b in by_depth] == [10, 80]
    updates = [e for e in pool.take_events() if isinstance(e, UpdatedEvent)]
    assert [u.priority for u in updates] == [(80, 10)]


def test_salt_isolates_prefixes() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
    prompt = toks(0, 2, 0)
    run(pool, "a", prompt, salt="tenant-a")
    assert where(pool, prompt, salt="tenant-a") == (2, 2, 0)
    assert where(pool, prompt, salt="tenant-b") == (0, 0, 0)
    assert where(pool, prompt, salt=None) == (0, 0, 0)
    alloc = pool.allocate("b", prompt + [1], salt="tenant-b", tenant="b", plan=DEFAULT_PLAN, now=0)
    assert alloc is not None and alloc.reused_blocks == 0


def test_decode_blocks_take_decode_priority_and_duration() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
    prompt = toks(0, 1, 2)  # 6 tokens: block 0 full, block 1 partial
    p = RetentionPlan((TokenRange(0, None, 70),), decode_priority=15, decode_duration_ms=500)
    alloc = pool.allocate("a", prompt, salt=None, tenant="t", plan=p, now=0.0, reserve_tokens=2)
    assert alloc is not None and len(alloc.slots) == 2
    slots, copies = pool.extend("a", 13, now=0.1)
    assert len(slots) == 4 and copies == ()
    generated = prompt + [900, 901, 902, 903, 904, 905, 906, 907]  # 14 tokens, 13 computed
    pool.release("a", generated, now=1.0)
    pool.check_invariants()
    blocks = {b.tokens: b for b in pool.cached_blocks().values()}
    priorities = sorted((b.priority, b.duration_ms) for b in blocks.values())
    # Blocks 0 and 1 start with prompt tokens (70); block 2 starts with a generated token (decode).
    assert priorities == [(15, 500), (70, None), (70, None)]


def test_last_prompt_token_is_never_matched() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
    prompt = toks(0, 2, 0)  # exactly two blocks
    run(pool, "a", prompt)
    alloc = pool.allocate("b", prompt, salt=None, tenant="t", plan=DEFAULT_PLAN, now=1)
    assert alloc is not None
    assert (alloc.reused_blocks, alloc.num_cached_tokens, alloc.new_blocks) == (1, B, 1)
    assert alloc.num_cached_tokens < len(prompt)
    # Releasing adopts the already stored twin of block 1 instead of storing a duplicate.
    pool.release("b", prompt, now=2, num_computed_tokens=len(prompt))
    pool.check_invariants()
    assert len(pool.cached_blocks()) == 2


def test_allocation_is_check_then_commit() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=3, secondary_blocks=1, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 0))
    held = pool.allocate("h", toks(50, 1, 1), salt=None, tenant="t", plan=DEFAULT_PLAN, now=0)
    assert held is not None
    before = (pool.stats(), {h: (b.tier, b.slot, b.priority) for h, b in pool.cached_blocks().items()})
    events_before = len(pool.take_events())
    assert not pool.can_allocate(toks(100, 3, 0), salt=None)
    assert pool.allocate("big", toks(100, 3, 0), salt=None, tenant="t", plan=DEFAULT_PLAN, now=1) is None
    after = (pool.stats(), {h: (b.tier, b.slot, b.priority) for h, b in pool.cached_blocks().items()})
    assert after == before and pool.take_events() == [] and events_before > 0
    assert pool.extend("h", 100, now=1) is None
    pool.check_invariants()


class TokenBlindSha256:
    """A hash that ignores the block's tokens: every chain of equal length collides."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def update(self, data: bytes) -> None:
        return None

    def digest(self) -> bytes:
        return hashlib.sha256(self._data).digest()


def test_token_comparison_on_hash_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing_module, "sha256", TokenBlindSha256)  # the pool hashes with retention.hashing
    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 0))
    assert pool.lookup(toks(500, 2, 1), salt=None) == (0, 0, 0)
    assert pool.lookup(toks(0, 2, 1), salt=None) == (2, 2, 0)
    run(pool, "b", toks(500, 2, 0))  # colliding chain is not stored over the first
    assert pool.lookup(toks(0, 2, 1), salt=None) == (2, 2, 0)


def test_tenant_blocks_follow_tiers() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=2, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 0), tenant="acme")
    assert pool.tenant_blocks() == {"acme": (2, 0)}
    alloc = pool.allocate("b", toks(100, 1, 1), salt=None, tenant="zeta", plan=DEFAULT_PLAN, now=0)
    assert alloc is not None
    assert pool.tenant_blocks() == {"acme": (0, 2), "zeta": (2, 0)}
    pool.release("b", toks(100, 1, 1), now=1)
    assert pool.tenant_blocks() == {"acme": (0, 2), "zeta": (1, 0)}  # partial block freed


def test_stats_follow_kvcachestats_counting() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 1))
    run(pool, "b", toks(0, 2, 1))
    s = pool.stats()
    assert (s.reused_blocks, s.missed_blocks) == (2, 3 + 1)
    assert s.cache_hit_rate == pytest.approx(2 / 6)
    assert s.alloc_total_blocks == 4 and s.alloc_new_blocks == 4
    assert s.max_num_blocks == s.free_num_blocks == 4 and s.used_num_blocks == 0


def test_events_rebuild_tree_and_stored_event_shape() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=2, tokens_per_block=B))
    run(pool, "a", toks(0, 2, 0), p=plan(60))
    events = pool.take_events()
    stored = [e for e in events if isinstance(e, StoredEvent)]
    assert len(stored) == 1 and stored[0].parent_hash is None
    assert [b.tokens for b in stored[0].blocks] == [tuple(range(0, 4)), tuple(range(4, 8))]
    assert {b.priority for b in stored[0].blocks} == {60}
    mirror = replay(events)
    assert set(mirror) == set(pool.cached_blocks())


def test_bad_calls_raise_clear_errors() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, tokens_per_block=B))
    with pytest.raises(PoolError, match="empty"):
        pool.allocate("a", [], salt=None, tenant=None, plan=DEFAULT_PLAN, now=0)
    with pytest.raises(PoolError, match="unknown request"):
        pool.release("nope", [1, 2], now=0)
    assert pool.allocate("a", [1, 2], salt=None, tenant=None, plan=DEFAULT_PLAN, now=0) is not None
    with pytest.raises(PoolError, match="already holds"):
        pool.allocate("a", [1, 2], salt=None, tenant=None, plan=DEFAULT_PLAN, now=0)
    with pytest.raises(PoolError, match="do not start with its prompt"):
        pool.release("a", [9, 9, 9], now=0)
    with pytest.raises(ValueError, match="int32"):
        pool.lookup([2**40], salt=None)
    with pytest.raises(PoolError):
        PoolConfig(primary_blocks=0)


def test_reuse_disabled_stores_nothing() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B, enable_block_reuse=False))
    run(pool, "a", toks(0, 2, 0))
    assert pool.cached_blocks() == {} and where(pool, toks(0, 2, 0)) == (0, 0, 0)


def test_pool_hashes_are_the_exported_block_hashes() -> None:
    from retention.hashing import block_hashes

    pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
    tokens = toks(3, 3, 0)
    run(pool, "a", tokens, salt="s")
    assert set(pool.cached_blocks()) == set(block_hashes(tokens, B, salt="s"))
    pool.allocate("x", tokens, salt="s", tenant=None, plan=DEFAULT_PLAN, now=1, extra_key=b"lora")
    pool.release("x", tokens, now=1, num_computed_tokens=len(tokens))
    assert set(block_hashes(tokens, B, salt="s", extra_key=b"lora")) <= set(pool.cached_blocks())


@pytest.mark.parametrize(
    ("ranges", "block", "length", "expected"),
    [  # The cases of TensorRT-LLM's KvCacheRetentionConfigTest.BlockConfigTest (kvCacheRetentionConfigTest.cpp).
        ([(0, 64, 80), (64, 128, 50)], 64, 256, [80, 50, None, None]),
        ([(0, 63, 80), (63, 127, 30)], 32, 127, [80, 80, 30, 30]),
        ([(0, 1, 80), (1, 2, 5)], 32, 128, [80, None, None, None]),
        ([(40, None, 60)], 32, 128, [None, None, 60, 60]),  # block 1 starts at 32 < 40
    ],
)
def test_block_takes_the_range_holding_its_first_token(ranges, block, length, expected) -> None:
    plan = RetentionPlan(tuple(TokenRange(s, e, p) for s, e, p in ranges))
    per_block = pool_module.per_block_retention(plan, -(-length // block), block)  # noqa: SLF001
    assert [None if r is None else r[0] for r in per_block] == expected


def test_duration_at_default_priority_never_starts() -> None:
    # LRUEvictionPolicy::releaseBlock only schedules expiry when the priority is not 35.
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B))
    run(pool, "a", toks(0, 1, 0), p=plan(35, duration_ms=10), now=0.0)
    (block,) = pool.cached_blocks().values()
    assert block.duration_ms == 10 and block.expires_at is None
    run(pool, "b", toks(50, 1, 0), now=100.0)
    assert pool.stats().expired_blocks == 0


def test_extend_can_offload_to_make_room_for_decode() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=2, secondary_blocks=1, tokens_per_block=B))
    run(pool, "cached", toks(0, 1, 0), p=plan(60))
    alloc = pool.allocate("d", toks(100, 0, 3), salt=None, tenant="t", plan=DEFAULT_PLAN, now=1)
    assert alloc is not None and alloc.copies == ()  # took the empty block
    slots, copies = pool.extend("d", 6, now=2)  # a second block: the cached one moves to host
    assert len(slots) == 2 and copies == (BlockCopy(P, slots[1], S, 0),)
    assert where(pool, toks(0, 1, 0)) == (1, 0, 1)
    pool.check_invariants()


def test_blocks_stored_while_running_are_reused_before_the_request_ends() -> None:
    """TensorRT-LLM stores a request's context blocks when its prefill ends and each new full block
    while it decodes (``storeContextBlocks`` / ``storeNewBlock``): a request sharing the prefix
    reuses them while the first still runs. Each block is stored (one Stored event) exactly once."""
    pool = BlockPool(PoolConfig(primary_blocks=16, tokens_per_block=B))
    prompt = toks(0, 3, 1)  # 13 tokens: 3 full blocks
    assert pool.allocate("a", prompt, salt=None, tenant="t", plan=DEFAULT_PLAN, now=0.0).reused_blocks == 0
    assert pool.allocate("early", prompt, salt=None, tenant="t", plan=DEFAULT_PLAN, now=0.0).reused_blocks == 0
    pool.release("early", prompt, now=0.0, num_computed_tokens=0)  # nothing computed: nothing stored
    assert not [e for e in pool.take_events() if isinstance(e, StoredEvent)]
    pool.store("a", prompt, num_computed_tokens=len(prompt) - 1)  # prefill done: tokens[:12] are 3 blocks
    stored = pool.take_events()
    assert [len(e.blocks) for e in stored if isinstance(e, StoredEvent)] == [3]
    reuse = pool.allocate("b", prompt, salt=None, tenant="t", plan=DEFAULT_PLAN, now=0.1)
    assert reuse.reused_blocks == 3 and reuse.num_cached_tokens == 12
    # "a" decodes 3 tokens (16 computed: a fourth full block), stored at that step; again is a no-op
    grown = prompt + [100, 101, 102]
    assert pool.extend("a", len(grown) + 1, now=0.2) is not None
    pool.store("a", grown + [103], num_computed_tokens=len(grown) + 1)
    pool.store("a", grown + [103], num_computed_tokens=len(grown) + 1)
    events = pool.take_events()
    assert [len(e.blocks) for e in events if isinstance(e, StoredEvent)] == [1] and events[0].parent_hash is not None
    assert pool.allocate("c", grown + [103, 7], salt=None, tenant="t", plan=DEFAULT_PLAN, now=0.3).reused_blocks == 4
    for rid, tokens in (("a", grown + [103, 104]), ("b", prompt), ("c", grown + [103, 7])):
        pool.release(rid, tokens, now=1.0)
        pool.check_invariants()
    assert not [e for e in pool.take_events() if isinstance(e, StoredEvent) and len(e.blocks) > 1]
    with pytest.raises(PoolError):
        pool.store("a", prompt, num_computed_tokens=4)  # released: no longer running
