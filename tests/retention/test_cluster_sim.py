"""Cluster simulator: one replica = the single-pool replay; precise predictions are exact; routers differ."""

from __future__ import annotations

import json

import pytest

from retention.simulation.cluster_sim import ClusterConfig, compare_routers, simulate_cluster
from retention.routing import CostModel
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import parse_trace
from retention.workloads import NoisyNeighbourSpec, noisy_neighbour_trace

BS = 16


@pytest.fixture(scope="module")
def chat():
    """Multi-turn sessions over one shared system prompt, plus a flood of unique prompts (small blocks)."""
    spec = NoisyNeighbourSpec(duration_s=300, block_size=BS, system_blocks=4, turns=5, premium_rps=2.0,
                              turn_gap_s=5.0, flood_factor=1.0, noisy_blocks=12, output_tokens=16)
    return parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=3)], block_size=BS)


CFG_NONE = SimConfig(tokens_per_block=BS, trace_block_size=BS, prefill_tokens_per_s=400.0, decode_tokens_per_s=8.0)
CFG_HOLD = SimConfig(tokens_per_block=BS, trace_block_size=BS, hold="tokens", prefill_tokens_per_s=400.0,
                     decode_tokens_per_s=8.0)


@pytest.mark.parametrize("config", [CFG_NONE, CFG_HOLD], ids=["hold-none", "hold-tokens"])
@pytest.mark.parametrize("router", ["round-robin", "kv-aware"])
def test_one_replica_is_exactly_the_single_pool_replay(chat, config, router) -> None:
    single = simulate(chat, make_policy("trtllm-default"), primary_blocks=40, secondary_blocks=80, config=config)
    cluster = simulate_cluster(
        chat, lambda: make_policy("trtllm-default"), cluster=ClusterConfig(1, router), primary_blocks=40,
        secondary_blocks=80, config=config,
    )
    t = cluster.total
    assert (t.gpu_hit_tokens, t.host_hit_tokens, t.rejected, t.delayed_requests, t.offloaded_blocks) == (
        single.gpu_hit_tokens, single.host_hit_tokens, single.rejected, single.delayed_requests, single.offloaded_blocks
    )
    assert t.total_wait_s == pytest.approx(single.total_wait_s)
    assert cluster.load_imbalance == 1.0


def test_precise_index_predicts_every_reused_block(chat) -> None:
    result = simulate_cluster(
        chat, lambda: make_policy("trtllm-default"), cluster=ClusterConfig(3, "kv-aware"), primary_blocks=30,
        secondary_blocks=60, config=CFG_NONE,
    )
    reused = (result.total.gpu_hit_tokens + result.total.host_hit_tokens) // BS
    assert reused > 0 and result.predicted_hit_blocks == reused


def test_accounting_adds_up_per_replica(chat) -> None:
    result = simulate_cluster(
        chat, lambda: make_policy("lru"), cluster=ClusterConfig(3, "session"), primary_blocks=30, secondary_blocks=0,
        config=CFG_HOLD,
    )
    assert sum(r.requests for r in result.replicas) == len(chat) == result.total.requests
    assert sum(r.prompt_tokens for r in result.replicas) == result.total.prompt_tokens
    for r in result.replicas:
        assert r.prefill_tokens == r.prompt_tokens - r.gpu_hit_tokens - r.host_hit_tokens
    values = [r.prefill_tokens for r in result.replicas]
    assert result.load_imbalance == pytest.approx(max(values) / (sum(values) / 3))


def test_kv_aware_keeps_most_of_the_reuse_that_round_robin_loses(chat) -> None:
    report = compare_routers(
        chat, lambda: make_policy("lru"),
        [ClusterConfig(4, "round-robin"), ClusterConfig(4, "kv-aware"),
         ClusterConfig(4, "kv-aware", index="approximate"), ClusterConfig(4, "kv-aware", cost=CostModel.dynamo())],
        labels=["round-robin", "kv-aware", "kv-aware approximate", "kv-aware dynamo"],
        primary_blocks=120, secondary_blocks=0, config=CFG_HOLD,
    )
    rr, kv = report.results["round-robin"], report.results["kv-aware"]
    # half the traffic is a flood of unique prompts and every router reuses the system
    # prompt, so the gap is the sessions' history: round-robin loses it, kv-aware keeps it
    assert kv.total.tenants["premium"].hit_rate > 1.15 * rr.total.tenants["premium"].hit_rate
    assert report.share_of_ceiling("kv-aware") > 0.9
    assert kv.load_imbalance < 1.3
    assert report.results["kv-aware approximate"].total.hit_rate > rr.total.hit_rate
    assert report.results["kv-aware dynamo"].total.hit_rate < kv.total.hit_rate
    assert report.ceiling.primary_blocks == 480


def test_salted_tenants_share_nothing_across_replicas() -> None:
    lines = []
    for i in range(40):  # two tenants send the very same prompts, alternately
        lines.append({"timestamp": i * 100_000, "input_length": 4 * BS, "output_length": 1,
                      "hash_ids": [0, 1, 2, 3 + i % 4], "tenant": "a" if i % 2 else "b"})
    trace = parse_trace([json.dumps(x) for x in lines], block_size=BS)
    salted = SimConfig(tokens_per_block=BS, trace_block_size=BS, salted=True)
    shared = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    runs = {
        name: simulate_cluster(trace, lambda: make_policy("lru"), cluster=ClusterConfig(2, "kv-aware"),
                               primary_blocks=64, secondary_blocks=0, config=config)
        for name, config in (("salted", salted), ("shared", shared))
    }
    # shared: tenant a's first request reuses tenant b's prefix; salted: each pays its own
    def hits(name: str, tenant: str) -> int:
        t = runs[name].total.tenants[tenant]
        return t.gpu_hit_tokens + t.host_hit_tokens

    assert hits("shared", "a") - hits("salted", "a") == 3 * BS
    assert hits("shared", "b") == hits("salted", "b") > 0
    assert runs["salted"].predicted_hit_blocks * BS == runs["salted"].total.hit_tokens


def test_gateways_share_the_events_and_split_the_load_view(chat) -> None:
    """Several gateways: every one sees every replica's events, each counts only its own dispatches."""
    def run(gateways: int, cost: CostModel):
        return simulate_cluster(
            chat, lambda: make_policy("trtllm-default"), primary_blocks=30, secondary_blocks=60, config=CFG_HOLD,
            cluster=ClusterConfig(3, "kv-aware", cost=cost, gateways=gateways))

    # no load term: the choice is the indexes' alone, and the indexes agree, so two gateways place as one
    cache_only = CostModel(balance_request_share=1e9)
    one, two = run(1, cache_only), run(2, cache_only)
    assert [r.requests for r in two.replicas] == [r.requests for r in one.replicas]
    assert two.total.gpu_hit_tokens == one.total.gpu_hit_tokens and two.predicted_hit_blocks == one.predicted_hit_blocks
    # with the load term each gateway balances its own half of the traffic: the placements differ,
    # and every request is still routed once
    one, two = run(1, CostModel()), run(2, CostModel())
    assert [r.requests for r in two.replicas] != [r.requests for r in one.replicas]
    assert sum(r.requests for r in two.replicas) == len(chat) == two.total.requests
    with pytest.raises(ValueError, match="gateways"):
        ClusterConfig(3, gateways=0)


def test_synced_gateways_route_as_one(chat) -> None:
    """Routing sync: each gateway applies its peers' dispatches, first tokens and completions
    (``retention/routing/sync.py``); with no delay the fleet's views are one gateway's."""
    def run(gateways: int, **sync):
        return simulate_cluster(
            chat, lambda: make_policy("trtllm-default"), primary_blocks=30, secondary_blocks=60, config=CFG_HOLD,
            cluster=ClusterConfig(3, "kv-aware", gateways=gateways, **sync))

    one, split, synced = run(1), run(2), run(2, sync=True)
    assert [r.requests for r in split.replicas] != [r.requests for r in one.replicas]  # the split view differs
    assert [r.requests for r in synced.replicas] == [r.requests for r in one.replicas]
    assert [r.prefill_tokens for r in synced.replicas] == [r.prefill_tokens for r in one.replicas]
    assert synced.total.hit_tokens == one.total.hit_tokens and synced.predicted_hit_blocks == one.predicted_hit_blocks
    # late notices: peers see each other's dispatches a second late; every request is still routed once
    late = run(2, sync=True, sync_delay_s=1.0)
    assert sum(r.requests for r in late.replicas) == len(chat) == late.total.requests
    assert [r.requests for r in late.replicas] != [r.requests for r in one.replicas]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sync_delay_s must be"):
            ClusterConfig(3, sync=True, sync_delay_s=bad)
    with pytest.raises(ValueError, match="sync=True only"):
        ClusterConfig(3, sync_delay_s=0.5)
