"""``adaptive`` with selection in the simulator: same selector as the gateway, one record per request."""

from __future__ import annotations

import json

import pytest

from retention.policy.adaptive import AdaptiveConfig, priority_for
from retention.pool import BlockPool, PoolConfig
from retention.policy.selection import AdaptiveSelectPolicy, AdaptiveSelector
from retention.shadow.duel import DuelConfig
from retention.simulation.sim_policies import ClassMapping, make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import distinct_blocks, parse_trace, parse_trace_events
from retention.types import DEFAULT_PLAN, TokenRange
from retention.workloads import ChatSpec, NoisyNeighbourSpec, chat_trace, noisy_neighbour_trace, phased
from retention.workloads.agent import AgentSpec
from retention.workloads.api import ApiSpec
from retention.workloads.mixed import MixedSpec, mixed_trace

B = 16


def trace(lines: list[dict]):  # noqa: ANN201
    return parse_trace([json.dumps(x) for x in lines], block_size=B)


@pytest.mark.parametrize("hold", ["none", "tokens"])
def test_each_request_is_recorded_once_whatever_the_admission_retries(hold: str) -> None:
    requests = trace(chat_trace(ChatSpec(duration_s=120, block_size=B, sessions_per_s=1.0), seed=3))
    policy = make_policy("adaptive")
    assert isinstance(policy, AdaptiveSelectPolicy) and policy.name == "adaptive"
    config = SimConfig(tokens_per_block=B, trace_block_size=B, hold=hold, prefill_tokens_per_s=200.0)
    result = simulate(requests, policy, primary_blocks=48, secondary_blocks=96, config=config)
    assert result.requests == len(requests)
    if hold == "tokens":
        assert result.delayed_requests > 0  # admission was retried, so plan() ran more than once for some
    duel = policy.selector.duel
    assert duel.sample.rate == 1.0  # a 48-block pool: raised so each shadow holds >= 64 blocks (capped at 1)
    with_blocks = sum(1 for r in requests if r.input_length >= B)
    assert all(shadow.counts.requests == with_blocks for shadow in duel.shadows)


def test_static_candidate_is_the_class_with_a_mapping() -> None:
    mapping = ClassMapping.from_dict({
        "offload_min_priority": 35, "default": "c",
        "classes": {"c": {s: {"priority": 70} for s in ("system", "context", "turn", "decode")}},
    })
    policy = make_policy("adaptive", mapping=mapping)
    assert policy.offload_min_priority == 35
    requests = trace(chat_trace(ChatSpec(duration_s=30, block_size=B), seed=1))
    pool = BlockPool(PoolConfig(primary_blocks=64, tokens_per_block=B, secondary_offload_min_priority=35))
    plan = policy.plan(requests[0], [], now=0.0, pool=pool)
    assert {r.priority for r in plan.ranges} == {70}  # the incumbent: the class


def test_selection_protects_the_premium_tenant_like_the_bands() -> None:
    spec = NoisyNeighbourSpec(duration_s=240, block_size=B)
    mixed = trace(noisy_neighbour_trace(spec, seed=3))
    config = SimConfig(tokens_per_block=B, trace_block_size=B)
    lru = simulate(mixed, make_policy("lru"), primary_blocks=96, secondary_blocks=0, config=config)
    policy = make_policy("adaptive")
    selected = simulate(mixed, policy, primary_blocks=96, secondary_blocks=0, config=config)
    assert policy.selector.duel.chosen() == "bands"
    assert selected.tenants["premium"].hit_rate > lru.tenants["premium"].hit_rate + 0.2


def test_host_tier_bands_never_drop_and_keep_recency_order() -> None:
    cfg = AdaptiveConfig()
    assert priority_for(0.001, 5, 30, cfg) == 0  # GPU only: measured one-shot traffic is dropped
    assert priority_for(0.001, 5, 30, cfg, host_tier=True) == 30  # with a host: offloaded, first out
    assert priority_for(0.5, 0, 30, cfg, host_tier=True) == 35 == priority_for(0.5, 4, 30, cfg, host_tier=True)
    assert priority_for(0.5, 4, 40, cfg, host_tier=True) == 40  # never below the threshold: always offloadable
    gpu_bands = AdaptiveConfig(host_mode="gpu")
    assert priority_for(0.5, 4, 30, gpu_bands, host_tier=True) == 46
    with pytest.raises(ValueError):
        AdaptiveConfig(host_mode="disk")


def test_selector_rejects_unknown_candidates() -> None:
    with pytest.raises(ValueError):
        AdaptiveSelector(64, names=("static", "lfu"))
    selector = AdaptiveSelector(64, names=("static",))
    plan = selector.plan(tenant=None, hashes=[], num_tokens=5, tokens_per_block=B, static=DEFAULT_PLAN, now=0.0)
    assert plan.ranges == (TokenRange(0, None, 35),) and plan.decode_priority == DEFAULT_PLAN.decode_priority


def test_selection_follows_a_workload_that_changes_character_half_way() -> None:
    """A flood next to premium chat (the bands win: they sink the flood), then plain chat at a
    capacity where the bands lose to LRU (measured: chat alone at 600 blocks, lru 68.6 % vs
    bands 65.0 %). The pool starts on the static plan, moves to the bands, and comes back.
    Two candidates: with ``protect`` too the chat phase is a near tie between static and
    protect (68.6 % vs 68.1 %), and this test is about the switching, not that tie."""
    first = noisy_neighbour_trace(NoisyNeighbourSpec(duration_s=240, block_size=B), seed=3)
    second = chat_trace(ChatSpec(duration_s=900, block_size=B, sessions_per_s=0.5), seed=3)
    requests = trace(phased(first, second))
    policy = make_policy("adaptive")
    policy.uses_host = False
    policy.names = ("static", "bands")
    simulate(requests, policy, primary_blocks=600, secondary_blocks=0, config=SimConfig(tokens_per_block=B,
                                                                                          trace_block_size=B))
    duel = policy.selector.duel
    assert duel.switches() == 2 and duel.chosen() == "static"  # static → bands → static


def test_default_candidates_depend_on_the_host_tier() -> None:
    assert AdaptiveSelector(64).names == ("static", "bands", "protect")
    assert AdaptiveSelector(64).tracker is not None
    with_host = AdaptiveSelector(64, 256)
    assert with_host.names == ("static", "bands") and with_host.tracker is None  # durations die on offload


def test_selection_follows_protect_where_lru_thrashes_on_chat() -> None:
    """Chat whose live conversations overflow a 30-block pool: LRU loses most histories during the
    think time; the protected subset keeps its own (measured: lru 20.4 %, protect 23.4 %)."""
    requests = trace(chat_trace(ChatSpec(duration_s=600, block_size=B), seed=0))
    config = SimConfig(tokens_per_block=B, trace_block_size=B)
    lru = simulate(requests, make_policy("lru"), primary_blocks=30, secondary_blocks=0, config=config)
    policy = make_policy("adaptive")
    selected = simulate(requests, policy, primary_blocks=30, secondary_blocks=0, config=config)
    assert policy.selector.duel.chosen() == "protect"
    assert selected.hit_rate > 1.1 * lru.hit_rate


def test_a_tenants_own_winner_does_not_cost_its_neighbour_the_pool() -> None:
    """Agent runs beside another tenant's one-shot API traffic (the ``agent-mixed`` family, shortened). The API
    tenant wins most on its own under the bands, whose kept bands (36, 46) outrank the agents' histories under
    ``protect`` or the static class (35, 45): followed per tenant, that mix lost the pool the agents' hits (below
    lru). The mix shadow sees it, so the pool keeps one choice and ends at least as high as protect or lru alone."""
    spec = MixedSpec(AgentSpec(duration_s=1200, block_size=B, responses=True, delete_share=0.5, tenant="agents"),
                     ApiSpec(duration_s=1200, block_size=B, requests_per_s=1.5, tenant="api"))
    requests, deletions = parse_trace_events([json.dumps(x) for x in mixed_trace(spec, seed=1)], block_size=B)
    gpu = round(0.01 * distinct_blocks(requests))
    config = SimConfig(tokens_per_block=B, trace_block_size=B)

    def run(name: str):  # noqa: ANN202
        policy = make_policy(name)
        return policy, simulate(requests, policy, primary_blocks=gpu, secondary_blocks=0, config=config,
                                deletions=deletions)

    (_, lru), (_, protect), (policy, adaptive) = run("lru"), run("protect"), run("adaptive")
    assert adaptive.hit_rate >= max(lru.hit_rate, protect.hit_rate) - 0.005
    duel = policy.selector.duel
    own = {t: duel.names[s.current] for t, s in duel.tenants.items() if s.refs >= duel.config.tenant_min_refs}
    assert own.get("api") == "bands" != own.get("agents")  # the tenants' own winners differ ...
    assert not duel.tenants_follow_own()  # ... and the mix gate keeps them on the pool's choice


def test_static_candidate_resets_what_another_candidate_raised() -> None:
    """TensorRT-LLM's claimBlock keeps a reused block's priority when no range covers it.

    So the selector sends ``static`` covering the whole prompt at 35: a block ``protect``
    or the bands raised goes back to 35 when the pool follows ``static``, as a new block
    would be, instead of staying raised for good.
    """
    from retention.policy.selection import covering
    from retention.types import RetentionPlan, TokenRange

    tokens = list(range(4 * B + 1))
    raised = RetentionPlan((TokenRange(0, None, 80),))

    def priorities_after(second: RetentionPlan) -> set[int]:
        pool = BlockPool(PoolConfig(primary_blocks=8, tokens_per_block=B))
        for rid, plan in (("raise", raised), ("reuse", second)):
            assert pool.allocate(rid, tokens, salt=None, tenant="t", plan=plan, now=0.0) is not None
            pool.release(rid, tokens, now=0.0, num_computed_tokens=len(tokens))
        return {b.priority for b in pool.free_order() if b.block_hash is not None}

    assert priorities_after(DEFAULT_PLAN) == {80}  # the C++ rule: uncovered keeps what it had
    assert priorities_after(covering(DEFAULT_PLAN, len(tokens))) == {35}

    selector = AdaptiveSelector(64, names=("static", "protect"))
    plan = selector.plan(tenant="t", hashes=[1, 2, 3, 4], num_tokens=len(tokens), tokens_per_block=B, now=0.0)
    assert [(r.start, r.end, r.priority, r.duration_ms) for r in plan.ranges] == [(0, None, 35, None)]
    # A plan with holes gets them filled at 35 and keeps its own ranges.
    holes = RetentionPlan((TokenRange(4, 8, 60), TokenRange(12, 16, 70, 1000)))
    assert [(r.start, r.end, r.priority) for r in covering(holes, 20).ranges] == [
        (0, 4, 35), (4, 8, 60), (8, 12, 35), (12, 16, 70), (16, None, 35)]
    full = RetentionPlan((TokenRange(0, None, 50),))
    assert covering(full, 20) is full


def test_after_a_switch_to_the_bands_first_uses_settle_at_35_until_the_pool_turned_over() -> None:
    """Blocks the previous candidate left at 35 would outrank the bands' first uses (T) for good, so
    the bands plan kept first uses at 35 until a pool's worth of them was planned, then at T again."""
    selector = AdaptiveSelector(8, names=("static", "bands"), duel_config=DuelConfig(rate=1.0))

    def first_use_priorities(start: int) -> set[int]:
        hashes = [start * 100 + i for i in range(4)]  # never seen: four first uses
        plan = selector.plan(tenant="t", hashes=hashes, num_tokens=4 * B, tokens_per_block=B, now=float(start))
        return {r.priority for r in plan.ranges}

    assert first_use_priorities(1) == {35}  # static, the incumbent
    selector.duel.pool_scope.current = 1  # the pool's choice moves to the bands on the duel's evidence
    assert first_use_priorities(2) == {35}  # settling: 4 of the pool's 8 blocks planned
    assert first_use_priorities(3) == {35}  # 8 of 8
    assert first_use_priorities(4) == {30}  # turned over: first uses at T again
    assert selector.settling <= 0

    unsettled = AdaptiveSelector(8, names=("static", "bands"), duel_config=DuelConfig(rate=1.0), settle=False)
    unsettled.duel.pool_scope.current = 1
    plan = unsettled.plan(tenant="t", hashes=[1, 2, 3, 4], num_tokens=4 * B, tokens_per_block=B, now=0.0)
    assert {r.priority for r in plan.ranges} == {30}
    hosted = AdaptiveSelector(8, 32, names=("static", "bands"), duel_config=DuelConfig(rate=1.0))
    hosted.duel.pool_scope.current = 1  # with a host tier the bands' first uses are at 35 anyway: no settling
    hosted.plan(tenant="t", hashes=[1, 2, 3, 4], num_tokens=4 * B, tokens_per_block=B, now=0.0)
    assert hosted.settling == 0


def test_settling_after_the_switch_recovers_what_static_left_at_35() -> None:
    spec = NoisyNeighbourSpec(duration_s=240, block_size=B)
    mixed = trace(noisy_neighbour_trace(spec, seed=3))
    gpu = round(distinct_blocks(mixed) * 0.02)
    config = SimConfig(tokens_per_block=B, trace_block_size=B)
    rates = {}
    for settle in (False, True):
        policy = make_policy("adaptive")
        policy.selector = AdaptiveSelector(gpu, 0, policy.offload_min_priority, policy.adaptive, policy.duel_config,
                                           policy.names, settle=settle)
        rates[settle] = simulate(mixed, policy, primary_blocks=gpu, secondary_blocks=0, config=config).hit_rate
        assert policy.selector.duel.chosen() == "bands" and policy.selector.duel.switches() == 1
    bands = simulate(mixed, make_policy("adaptive-bands"), primary_blocks=gpu, secondary_blocks=0, config=config)
    # Measured: 4.42 % unsettled, 4.97 % settled, the bands alone 5.01 %.
    assert rates[True] > rates[False] + 0.003
    assert rates[True] > bands.hit_rate - 0.001
