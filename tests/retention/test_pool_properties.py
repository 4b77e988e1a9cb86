"""Property tests: random operation sequences against the pool's invariants."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retention.pool.blocks import Block
from retention.pool.events import RemovedEvent, StoredEvent, UpdatedEvent, replay
from retention.pool import BlockPool, PoolConfig
from retention.types import RetentionPlan, Tier, TokenRange

B = 4
P, S = Tier.PRIMARY, Tier.SECONDARY
PRIORITIES = st.sampled_from([0, 10, 29, 30, 34, 35, 36, 60, 90, 100])
DURATIONS = st.sampled_from([None, None, 50, 400, 2_000])


def prompt_tokens(root: int, shared_blocks: int, branch: int, tail: int) -> list[int]:
    base = [root * 10_000 + i for i in range(shared_blocks * B)]
    return base + [root * 10_000 + 5_000 + branch * 100 + i for i in range(tail)]


@st.composite
def plans(draw) -> RetentionPlan:
    cuts = sorted(set(draw(st.lists(st.integers(1, 20), max_size=3))))
    starts = [0, *cuts]
    ranges = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        if draw(st.booleans()) or i == 0:
            ranges.append(TokenRange(start, end, draw(PRIORITIES), draw(DURATIONS)))
    return RetentionPlan(tuple(ranges), draw(PRIORITIES), draw(DURATIONS))


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("alloc"), st.integers(0, 2), st.integers(0, 3), st.integers(0, 2), st.integers(1, 6),
            st.sampled_from([None, "s1"]), plans(), st.sampled_from([0, 0, 2, 6]),
        ),
        st.tuples(st.just("release"), st.integers(0, 7), st.integers(0, 9), st.sampled_from([False, False, False, True])),
        st.tuples(st.just("release"), st.integers(0, 7), st.integers(0, 9), st.just(False)),
        st.tuples(st.just("extend"), st.integers(0, 7), st.integers(1, 8)),
        st.tuples(st.just("tick"), st.sampled_from([0.01, 0.1, 0.5, 3.0])),
    ),
    min_size=1,
    max_size=60,
)


def expected_victim(pool: BlockPool, tier: Tier) -> Block | None:
    """Independent rule: an empty block if any, else the free tier-leaf with the lowest (priority, release order)."""
    blocks = [b for b in pool.all_blocks() if b.tier == tier and b.ref_count == 0]
    empty = [b for b in blocks if not b.in_tree]
    if empty:
        return None  # any empty block is acceptable; checked separately
    def is_leaf(b: Block) -> bool:
        return not any(c.tier == tier for c in (b.children or {}).values())
    leaves = [b for b in blocks if is_leaf(b)]
    return min(leaves, key=lambda b: (b.priority, b.release_seq)) if leaves else None


def tree_snapshot(pool: BlockPool) -> dict[int, tuple[int | None, Tier, int]]:
    return {
        h: (None if b.parent is None else b.parent.block_hash, b.tier, b.priority)
        for h, b in pool.cached_blocks().items()
    }


class Driver:
    """Executes operations on a pool and checks every invariant after each one."""

    def __init__(self, primary: int, secondary: int, threshold: int) -> None:
        self.pool = BlockPool(
            PoolConfig(primary_blocks=primary, secondary_blocks=secondary, tokens_per_block=B,
                       secondary_offload_min_priority=threshold)
        )
        self.primary, self.secondary, self.threshold = primary, secondary, threshold
        self.mirror = replay(self.pool.take_events())
        self.active: list[tuple[str, list[int]]] = []
        self.now = 0.0
        self.counter = 0
        self.seen = {"onboarded": 0, "offloaded": 0, "reused": 0, "rejected": 0}

    def step(self, op) -> None:
        pool = self.pool
        for tier in (P, S):
            want = expected_victim(pool, tier)
            got = pool.peek_victim(tier)
            if want is None:
                assert got is None or not got.in_tree
            else:
                assert got is want, "eviction order must be (priority, LRU) among free leaves"
        if op[0] == "alloc":
            _, root, shared, branch, tail, salt, plan, reserve = op
            tokens = prompt_tokens(root, shared, branch, tail)
            self.counter += 1
            rid = f"r{self.counter}"
            fits = pool.can_allocate(tokens, salt=salt, reserve_tokens=reserve)
            before = tree_snapshot(pool)
            alloc = pool.allocate(rid, tokens, salt=salt, tenant=f"t{root}", plan=plan, now=self.now,
                                  reserve_tokens=reserve)
            assert (alloc is not None) == fits
            if alloc is None:
                self.seen["rejected"] += 1
                assert tree_snapshot(pool) == before and pool.take_events() == []
            else:
                assert len(set(alloc.slots)) == len(alloc.slots)
                assert alloc.num_cached_tokens < len(tokens)
                self.seen["onboarded"] += alloc.onboarded_blocks
                self.seen["reused"] += alloc.reused_blocks
                self.active.append((rid, tokens))
        elif op[0] == "release" and self.active:
            _, index, generated, cancel = op
            rid, tokens = self.active.pop(index % len(self.active))
            capacity = len(pool._seqs[rid].blocks) * B  # noqa: SLF001 - the capacity it granted
            seq_tokens = (tokens + [77_000 + i for i in range(generated)])[: max(capacity, len(tokens))]
            pool.release(rid, seq_tokens, now=self.now, num_computed_tokens=0 if cancel else None)
        elif op[0] == "extend" and self.active:
            _, index, more = op
            rid, _tokens = self.active[index % len(self.active)]
            pool.extend(rid, len(pool._seqs[rid].blocks) * B + more, now=self.now)  # noqa: SLF001
        elif op[0] == "tick":
            self.now += op[1]
        pool.check_invariants()
        for event in pool.take_events():
            if isinstance(event, UpdatedEvent) and event.cache_level == (P, S):
                assert self.mirror[event.block_hash].priority >= self.threshold, "offload below threshold"
                self.seen["offloaded"] += 1
            assert isinstance(event, (StoredEvent, RemovedEvent, UpdatedEvent))
            replay([event], self.mirror)
        assert {h: (n.parent, n.tier, n.priority) for h, n in self.mirror.items()} == tree_snapshot(pool)
        stats = pool.stats()
        assert stats.used_num_blocks + stats.free_num_blocks == self.primary
        assert stats.secondary_used_blocks <= self.secondary

    def drain(self) -> None:
        for rid, tokens in self.active:
            self.pool.release(rid, tokens, now=self.now)
        self.active.clear()
        self.pool.check_invariants()
        assert self.pool.stats().used_num_blocks == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(primary=st.integers(3, 12), secondary=st.integers(0, 6), threshold=st.sampled_from([30, 35]), program=ops)
def test_random_operation_sequences_keep_invariants(primary: int, secondary: int, threshold: int, program) -> None:
    driver = Driver(primary, secondary, threshold)
    for op in program:
        driver.step(op)
    driver.drain()


def test_long_seeded_runs_exercise_offload_and_onboard() -> None:
    """Long runs (hypothesis keeps examples short) with a tier mix that forces traffic both ways."""
    total = {"onboarded": 0, "offloaded": 0, "reused": 0, "rejected": 0}
    for seed, (primary, secondary, threshold) in enumerate([(6, 6, 30), (8, 3, 35), (10, 10, 30), (5, 0, 30)]):
        rng = random.Random(seed)
        driver = Driver(primary, secondary, threshold)
        for _ in range(600):
            kind = rng.random()
            if kind < 0.45:
                cuts = sorted(rng.sample(range(1, 20), 2))
                plan = RetentionPlan(
                    (
                        TokenRange(0, cuts[0], rng.choice([10, 30, 60, 90]), rng.choice([None, 300])),
                        TokenRange(cuts[1], None, rng.choice([0, 35, 40]), None),
                    ),
                    rng.choice([0, 35, 50]),
                    rng.choice([None, 200]),
                )
                op = ("alloc", rng.randrange(3), rng.randrange(4), rng.randrange(3), rng.randrange(1, 5),
                      rng.choice([None, "s1"]), plan, rng.choice([0, 0, 3]))
            elif kind < 0.85:
                op = ("release", rng.randrange(8), rng.randrange(6), rng.random() < 0.1)
            elif kind < 0.93:
                op = ("extend", rng.randrange(8), rng.randrange(1, 6))
            else:
                op = ("tick", rng.choice([0.05, 0.5, 1.0]))
            driver.step(op)
        driver.drain()
        for key, value in driver.seen.items():
            total[key] += value
    assert total["onboarded"] > 50 and total["offloaded"] > 50 and total["reused"] > 200
