"""Demote on delete: the ledger's shared-prefix rule, the plan, the cut prompt, the pool and the simulator."""

from __future__ import annotations

import json

import pytest

import random

from retention.policy.demote import (DemoteLedger, demote_length, demote_plan, demote_priority, demote_start, orphaned,
                                     shared_blocks)
from retention.pool import BlockPool, PoolConfig
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import parse_trace_events
from retention.types import RetentionPlan, TokenRange

B = 4
CONFIG = SimConfig(tokens_per_block=B, trace_block_size=B)


def test_a_delete_demotes_only_blocks_no_other_live_response_holds() -> None:
    ledger = DemoteLedger()
    ledger.stored("t", "a1", [1, 2, 10])  # system (1, 2) + conversation a
    ledger.stored("t", "a2", [1, 2, 10, 11])  # a's next step
    ledger.stored("t", "b1", [1, 2, 20])  # conversation b shares the system blocks
    assert ledger.delete("t", "a1") is None  # every block still inside a2
    assert ledger.delete("t", "a2") == 2  # past the prefix b shares
    assert ledger.delete("t", "a2") is None  # unknown now
    assert ledger.delete("t", "b1") == 0  # nobody else holds the system blocks any more
    assert ledger.live("t") == 0
    assert ledger.delete("other", "b1") is None


def test_the_start_from_the_stored_prompts_is_the_ledgers_and_a_protected_head_is_never_demoted() -> None:
    a1, a2, b1 = (1, 2, 10), (1, 2, 10, 11), (1, 2, 20)
    assert shared_blocks(a2, b1) == 2 and shared_blocks(a1, a2) == 3 and shared_blocks((), a1) == 0
    assert demote_start(a1, [a2, b1]) is None  # every block still inside a2
    assert demote_start(a2, [b1]) == 2  # past the prefix b shares
    assert demote_start(b1, []) == 0 and demote_start(b1, [], protected_blocks=2) == 2
    assert demote_start(b1, [], protected_blocks=3) is None  # all of it protected
    with pytest.raises(ValueError):
        demote_start(b1, [], protected_blocks=-1)


def test_demote_start_agrees_with_the_ledger_on_random_forking_conversations() -> None:
    rng = random.Random(7)  # seed: the forks and delete order below
    for _ in range(200):
        prompts: dict[str, tuple[int, ...]] = {}
        ledger = DemoteLedger()
        for i in range(rng.randint(1, 8)):  # each prompt forks an earlier one at a random depth (chained ids)
            base = prompts[rng.choice(list(prompts))] if prompts and rng.random() < 0.8 else ()
            cut = base[:rng.randint(0, len(base))]
            prompts[f"r{i}"] = cut + tuple(hash((cut, i, j)) for j in range(rng.randint(0 if cut else 1, 4)))
            ledger.stored("t", f"r{i}", prompts[f"r{i}"])
        order = list(prompts)
        rng.shuffle(order)
        live = dict(prompts)
        for rid in order:
            deleted = live.pop(rid)
            assert demote_start(deleted, live.values()) == ledger.delete("t", rid)


def test_tenants_do_not_share_counts() -> None:
    ledger = DemoteLedger()
    ledger.stored("x", "r", [1, 2, 3])
    ledger.stored("y", "r", [1, 2, 3])
    assert ledger.delete("x", "r") == 0


def test_demote_plan_keeps_the_normal_plan_before_the_range_and_zero_after() -> None:
    normal = RetentionPlan((TokenRange(0, 8, 60, 5000), TokenRange(8, None, 40, None)), 60, 5000)
    got = demote_plan(normal, 12)
    assert got.ranges == (TokenRange(0, 8, 60, 5000), TokenRange(8, 12, 40, None), TokenRange(12, None, 0, None))
    assert (got.decode_priority, got.decode_duration_ms) == (0, None)
    assert demote_plan(RetentionPlan(), 0).ranges == (TokenRange(0, None, 0, None),)
    with pytest.raises(ValueError):
        demote_plan(normal, -1)


@pytest.mark.parametrize("cached, start, prompt, want", [
    (3, 8, 20, 13),  # 3 cached blocks (12 tokens) past the start at 8: send 12 + 1
    (2, 8, 20, None),  # nothing of its own cached
    (5, 0, 20, 20),  # all cached: the whole prompt (the last token is never matched)
    (0, 0, 20, None),
])
def test_demote_length_is_the_cached_prefix_plus_one(cached: int, start: int, prompt: int, want: int | None) -> None:
    assert demote_length(cached, start, B, prompt) == want


def test_a_held_block_reclaimed_at_priority_zero_is_evicted_first() -> None:
    """``claimBlock`` overrides a matched block's priority even downwards and replaces its duration."""
    pool = BlockPool(PoolConfig(primary_blocks=4, tokens_per_block=B))
    shared, own = list(range(0, B)), list(range(100, 100 + B))
    held = RetentionPlan((TokenRange(0, None, 60, 3_600_000),))

    def run(rid: str, tokens: list[int], plan: RetentionPlan) -> None:
        assert pool.allocate(rid, tokens, salt=None, tenant="t", plan=plan, now=0.0) is not None
        pool.release(rid, tokens, now=0.0, num_computed_tokens=len(tokens))

    run("conv", shared + own + [7], held)
    run("demote", shared + own + [7], demote_plan(held, B))
    blocks = sorted(pool.cached_blocks().values(), key=lambda b: b.parent is not None)
    assert [(b.priority, b.duration_ms) for b in blocks] == [(60, 3_600_000), (0, None)]
    run("other", list(range(200, 200 + 2 * B)) + [7], RetentionPlan())  # needs 3 blocks: one victim
    assert pool.lookup(shared + own + [7], salt=None)[0] == 1  # the demoted block went, the shared one stayed


@pytest.mark.parametrize("host, threshold, want", [
    (0, 30, 0),  # no host tier: first in line, dropped either way
    (64, 30, 30),  # a host tier: first out of the GPU, but offloaded
    (64, 0, 0),  # every priority offloads: 0 already does
    (64, 40, 0),  # a threshold above the default 35 would lift the blocks over unheld ones
    (64, 101, 0),  # never offloads
])
def test_a_pool_with_a_host_tier_demotes_to_its_offload_threshold(host: int, threshold: int, want: int) -> None:
    assert demote_priority(host, threshold) == want


@pytest.mark.parametrize("with_host_priority", [False, True])
def test_a_demoted_block_goes_to_host_only_at_the_threshold(with_host_priority: bool) -> None:
    """``getFreeBlock`` offloads a victim iff its priority is at or above the threshold and a
    host block is free; below it the victim is dropped (evictionPolicy.cpp)."""
    config = PoolConfig(primary_blocks=4, secondary_blocks=8, tokens_per_block=B, secondary_offload_min_priority=30)
    pool = BlockPool(config)
    shared, own = list(range(0, B)), list(range(100, 100 + B))
    held = RetentionPlan((TokenRange(0, None, 60, 3_600_000),))
    at = demote_priority(config.secondary_blocks, config.secondary_offload_min_priority) if with_host_priority else 0

    def run(rid: str, tokens: list[int], plan: RetentionPlan) -> None:
        assert pool.allocate(rid, tokens, salt=None, tenant="t", plan=plan, now=0.0) is not None
        pool.release(rid, tokens, now=0.0, num_computed_tokens=len(tokens))

    run("conv", shared + own + [7], held)
    run("demote", shared + own + [7], demote_plan(held, B, at))
    run("other", list(range(200, 200 + 2 * B)) + [7], RetentionPlan())  # needs 3 blocks: the demoted one leaves
    matched, _, on_host = pool.lookup(shared + own + [7], salt=None)
    assert (matched, on_host) == ((2, 1) if with_host_priority else (1, 0))  # kept on host at 30, gone at 0


def _trace() -> tuple[list, list]:
    def line(at: float, ids: list[int], rid: str, prev: str | None = None) -> str:
        obj = {"timestamp": at, "input_length": len(ids) * B + 1, "output_length": 1, "hash_ids": ids + [900 + int(at)],
               "response_id": rid, "store": True, "offers_tools": True}
        if prev:
            obj["previous_response_id"] = prev
        return json.dumps(obj)

    lines = [line(0, [1, 2, 10], "a1"), line(1000, [1, 2, 10, 11], "a2", "a1"), line(2000, [1, 2, 20], "b1"),
             json.dumps({"timestamp": 3000, "op": "delete_response", "response_id": "a1"}),
             json.dumps({"timestamp": 3000, "op": "delete_response", "response_id": "a2"}),
             line(4000, [1, 2, 20, 21], "b2", "b1")]
    return parse_trace_events(lines, block_size=B)


def test_the_simulator_replays_one_demote_per_deleted_chain_counted_apart() -> None:
    requests, deletions = _trace()
    base = simulate(requests, make_policy("lru+conv", block_size=B), primary_blocks=64, secondary_blocks=0,
                    config=CONFIG, deletions=deletions)
    demoted = simulate(requests, make_policy("lru+conv+demote", block_size=B), primary_blocks=64, secondary_blocks=0,
                       config=CONFIG, deletions=deletions)
    assert demoted.policy == "lru+conv+demote"
    assert (base.demote_requests, demoted.demote_requests) == (0, 1)
    assert demoted.demote_computed_tokens == 1  # the cut prompt: cached blocks + one token
    assert (demoted.requests, demoted.prompt_tokens) == (base.requests, base.prompt_tokens)  # never in the hit rate
    assert demoted.hit_tokens == base.hit_tokens  # room for everything: the demote changes no hit


def test_a_delete_orphans_its_descendants_and_names_their_leaves() -> None:
    #   r1 ─ r2 ─ r3 ─ r4        (a chain)
    #         └─ f1             (a fork off r2)
    #   r1 ─ g1                 (a fork off r1)
    parents = {"r1": None, "r2": "r1", "r3": "r2", "f1": "r2", "r4": "r3", "g1": "r1"}
    assert orphaned(parents, "r2") == ({"r2", "r3", "r4", "f1"}, ["f1", "r4"])
    assert orphaned(parents, "r4") == ({"r4"}, ["r4"])
    assert orphaned(parents, "r1") == (set(parents), ["f1", "r4", "g1"])
    assert orphaned(parents, "gone") == ({"gone"}, ["gone"])  # not among the live rows: itself only
    assert orphaned({"a": "b", "b": "a"}, "c") == ({"c"}, ["c"])  # no loop on a cycle
