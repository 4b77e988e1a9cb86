"""Affinity keys (``prompt_cache_key``): same key, same replica, unless the load band says otherwise."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.pool import BlockPool, PoolConfig
from retention.routing import (
    Candidate,
    CostModel,
    ReplicaLoad,
    RouteRequest,
    RoutingError,
    affinity_key,
    home_replica,
    make_router,
)
from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig
from retention.trace import TraceError, parse_trace
from retention.workloads import AgentSpec, ChatSpec, agent_trace, chat_trace

TPB = 4


def fresh(seed: int, blocks: int) -> tuple[int, ...]:
    """A prompt's chain that no replica holds (distinct per seed)."""
    return tuple(1_000_003 * seed + i + 1 for i in range(blocks))


def request(rid, key: int | None, seed: int, blocks: int = 3) -> RouteRequest:
    return RouteRequest(rid, fresh(seed, blocks), blocks * TPB + 1, 4, affinity_key=key)


keys = st.text(min_size=0, max_size=20)
tenants = st.one_of(st.none(), st.text(min_size=1, max_size=8))


@settings(max_examples=150, deadline=None)
@given(tenants, keys, st.integers(2, 8),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 5000), st.integers(0, 200)), min_size=1, max_size=8))
def test_same_key_same_replica_absent_load_imbalance(tenant, key, count, steps) -> None:
    router = make_router("kv-aware", tokens_per_block=TPB)
    k = affinity_key(tenant, key)
    home = home_replica(k, [Candidate(i) for i in range(count)])
    for n, (seed, queued, active) in enumerate(steps):  # different prompts, none cached, one key
        load = ReplicaLoad(queued_prefill_tokens=queued, active_blocks=active, recent_prefill_tokens=float(queued))
        candidates = [Candidate(i, load=load) for i in range(count)]  # every replica equally loaded
        assert router.route(request(n, k, seed), candidates, now=float(n)).replica == home


def test_different_tenants_same_key_are_independent() -> None:
    assert affinity_key("a", "k") != affinity_key("b", "k")
    assert affinity_key("ab", "c") != affinity_key("a", "bc")  # the tenant is length-prefixed
    assert affinity_key(None, "k") == affinity_key("", "k") == affinity_key(None, "k")
    candidates = [Candidate(i) for i in range(4)]
    same = sum(home_replica(affinity_key("a", f"k{i}"), candidates) == home_replica(affinity_key("b", f"k{i}"),
                                                                                     candidates)
               for i in range(4000))
    assert 0.2 < same / 4000 < 0.3  # independent homes agree 1 time in 4
    spread = Counter(home_replica(affinity_key("a", f"k{i}"), candidates) for i in range(4000))
    assert all(800 < n < 1200 for n in spread.values())


def test_home_follows_weight_and_moves_only_its_own_keys() -> None:
    full = [Candidate(0), Candidate(1, weight=2), Candidate(2)]
    homes = {i: home_replica(affinity_key("t", str(i)), full) for i in range(3000)}
    assert 1300 < Counter(homes.values())[1] < 1700  # weight 2: half the keys
    without = [c for c in full if c.replica != 2]
    for i, home in homes.items():
        if home != 2:
            assert home_replica(affinity_key("t", str(i)), without) == home
    with pytest.raises(RoutingError):
        home_replica(1, [])
    with pytest.raises(RoutingError):
        affinity_key("t", 5)  # type: ignore[arg-type]


def test_the_load_band_overrules_the_key() -> None:
    router = make_router("kv-aware", tokens_per_block=TPB)
    candidates = [Candidate(i) for i in range(3)]
    k = affinity_key("t", "conversation")
    home = home_replica(k, candidates)
    r = request("r", k, 7)
    prompt_blocks = r.prompt_tokens / TPB
    # home's queued prefill within the band (one request's blocks): the key still wins
    inside = [Candidate(c.replica, load=ReplicaLoad(queued_prefill_tokens=int(0.9 * prompt_blocks * TPB))
                        if c.replica == home else None) for c in candidates]
    assert router.route(r, inside, now=0.0).replica == home
    # far beyond the band: the key's credit is outweighed, another replica serves
    beyond = [Candidate(c.replica, load=ReplicaLoad(queued_prefill_tokens=40 * TPB) if c.replica == home else None)
              for c in candidates]
    assert router.route(r, beyond, now=0.0).replica != home


def test_a_cached_prefix_elsewhere_outweighs_the_credit_and_a_short_one_does_not() -> None:
    candidates = [Candidate(i) for i in range(2)]
    k = next(affinity_key("t", f"k{i}") for i in range(100) if home_replica(affinity_key("t", f"k{i}"), candidates) == 0)
    for held, expected in ((4, 1), (1, 0)):  # replica 1 holds `held` leading blocks; credit is 1 block
        router = make_router("kv-aware", tokens_per_block=TPB, cost=CostModel(affinity_credit=1.5))
        pool = BlockPool(PoolConfig(primary_blocks=64, secondary_blocks=0, tokens_per_block=TPB))
        prompt = list(range(8 * TPB + 1))
        r0 = RouteRequest.from_tokens("warm", prompt[: held * TPB + 1], tokens_per_block=TPB, salt=None)
        assert pool.allocate("warm", prompt[: held * TPB + 1], salt=None, tenant=None, now=0.0) is not None
        pool.release("warm", prompt[: held * TPB + 1], now=0.0, num_computed_tokens=held * TPB + 1)
        router.apply_events(1, pool.take_events(), now=0.0)
        assert router.match(1, r0.hashes, now=0.0).blocks == held
        r = RouteRequest.from_tokens("q", prompt, tokens_per_block=TPB, salt=None, affinity_key=k)
        assert router.route(r, candidates, now=0.0).replica == expected


def test_the_session_router_sticks_to_the_key() -> None:
    router = make_router("session", tokens_per_block=TPB)
    candidates = [Candidate(i) for i in range(5)]
    k = affinity_key("t", "agent-1")
    assert {router.route(request(n, k, n), candidates, now=0.0).replica for n in range(20)} == {
        home_replica(k, candidates)}


def test_traces_carry_the_key_and_the_generators_emit_the_conversation() -> None:
    line = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "prompt_cache_key": "c-1"}
    (parsed,) = parse_trace([json.dumps(line)])
    assert parsed.hints is not None and parsed.hints.cache_key == "c-1"
    with pytest.raises(TraceError, match="prompt_cache_key"):
        parse_trace([json.dumps({**line, "prompt_cache_key": 3})])
    for lines in (chat_trace(ChatSpec(duration_s=120), seed=1), agent_trace(AgentSpec(duration_s=120), seed=1)):
        by_key: dict[str, list[list[int]]] = {}
        for x in lines:
            by_key.setdefault(x["prompt_cache_key"], []).append(x["hash_ids"])
        assert len(by_key) > 3
        for prompts in by_key.values():  # one conversation: every turn extends the one before
            for a, b in zip(prompts, prompts[1:]):
                assert b[: len(a) - 1] == a[:-1]


def test_the_cluster_simulator_routes_by_the_key() -> None:
    lines = chat_trace(ChatSpec(duration_s=300), seed=3)
    trace = parse_trace([json.dumps(x) for x in lines])
    config = SimConfig(tokens_per_block=512)

    def placements(affinity: bool) -> dict[str, set[int]]:
        result = simulate_cluster(trace, lambda: make_policy("lru"), cluster=ClusterConfig(4, affinity=affinity),
                                  primary_blocks=4000, secondary_blocks=0, config=config)
        assert sum(r.requests for r in result.replicas) == len(trace)
        return result

    keyed = placements(True)
    # with keys and capacity to spare, all four replicas serve and reuse stays near the no-key run's
    assert all(r.requests for r in keyed.replicas)
    assert keyed.total.hit_rate >= placements(False).total.hit_rate - 0.02
