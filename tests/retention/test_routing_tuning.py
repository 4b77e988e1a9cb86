"""The self-tuning band (``kv-adaptive``): deterministic, widens where following the cache is
even, narrows where it piles load on one replica, never crosses the hard limit."""

from __future__ import annotations

import random

import pytest

from retention.routing import (
    BandTuning,
    Candidate,
    CapacityModel,
    CostModel,
    RouteRequest,
    RoutingError,
    SelfTuningRouter,
    approximate_indexes,
    make_router,
)
from retention.routing.tuning import BandController, scaled

TPB = 4
REPLICAS = 4


def router(name: str = "kv-adaptive", tuning: BandTuning = BandTuning(), seed: int = 0):  # noqa: ANN201
    """Approximate indexes: the router learns placements from its own dispatches (no engine events)."""
    extra = {"tuning": tuning} if name == "kv-adaptive" else {}
    return make_router(name, tokens_per_block=TPB, index_factory=approximate_indexes(CapacityModel(10_000, 0)),
                       rng=random.Random(seed), **extra)


def conversations(seed: int, count: int = 48, turns: int = 6) -> list[RouteRequest]:
    """``count`` conversations of similar size, turns interleaved at random: each turn extends its
    conversation's chain by a few blocks, so a turn's prefix is where its previous turn went."""
    rng = random.Random(seed)
    chains = {c: [] for c in range(count)}
    order = [c for c in range(count) for _ in range(turns)]
    rng.shuffle(order)
    out = []
    for n, c in enumerate(order):
        chains[c] += [10_000_019 * (c + 1) + len(chains[c]) + i for i in range(rng.randint(4, 6))]
        out.append(RouteRequest(n, tuple(chains[c]), len(chains[c]) * TPB + 1, 4))
    return out


def hot_prefix(seed: int, count: int = 300, shared: int = 40) -> list[RouteRequest]:
    """Every request opens with one long shared prefix, then a short tail of its own."""
    rng = random.Random(seed)
    prefix = tuple(range(1, shared + 1))
    out = []
    for n in range(count):
        tail = tuple(7_000_003 * (n + 1) + i for i in range(rng.randint(2, 4)))
        out.append(RouteRequest(n, prefix + tail, (shared + len(tail)) * TPB + 1, 4))
    return out


def replay(r, requests: list[RouteRequest]) -> tuple[list[int], int, float]:  # noqa: ANN001
    """Route each request, dispatch it, complete it a step later; returns choices, reused blocks and the
    imbalance (max / mean) of prefill tokens computed per replica."""
    candidates = [Candidate(i) for i in range(REPLICAS)]
    choices, reused, prefill = [], 0, [0] * REPLICAS
    for n, req in enumerate(requests):
        now = float(n)
        decision = r.route(req, candidates, now=now)
        r.on_dispatch(req, decision, now=now)
        hit = min(decision.match.blocks + decision.match.pending_blocks, (req.prompt_tokens - 1) // TPB)
        reused += hit
        prefill[decision.replica] += req.prompt_tokens - hit * TPB
        choices.append(decision.replica)
        if n:
            r.on_prefill_done(requests[n - 1].request_id, now=now)
            r.on_complete(requests[n - 1].request_id, now=now)
    return choices, reused, max(prefill) / (sum(prefill) / len(prefill))


def test_same_sequence_same_choices_and_scale() -> None:
    requests = conversations(3)
    a, b = router(seed=5), router(seed=5)
    assert replay(a, requests) == replay(b, requests)
    assert a.band.scale == b.band.scale and a.band.prefill == b.band.prefill


def test_widens_where_following_the_cache_stays_even() -> None:
    requests = conversations(1)
    adaptive, fixed = router(), router("kv-aware")
    _, reused, imbalance = replay(adaptive, requests)
    _, fixed_reused, _ = replay(fixed, requests)
    assert adaptive.band.scale > 1  # wider than the fixed default
    assert reused >= fixed_reused
    assert imbalance <= 1.3


def test_narrows_where_following_the_cache_piles_up() -> None:
    requests = hot_prefix(2)
    adaptive, fixed = router(), router("kv-aware")
    _, _, imbalance = replay(adaptive, requests)
    _, _, fixed_imbalance = replay(fixed, requests)
    assert adaptive.band.scale < 1  # tighter than the fixed default
    assert imbalance < fixed_imbalance


def test_scale_stays_within_its_bounds() -> None:
    tuning = BandTuning(min_scale=0.5, max_scale=2.0, window=1, warmup_per_replica=1)
    for requests in (conversations(4), hot_prefix(4)):
        r = router(tuning=tuning)
        scales = []
        candidates = [Candidate(i) for i in range(REPLICAS)]
        for n, req in enumerate(requests):
            r.on_dispatch(req, r.route(req, candidates, now=float(n)), now=float(n))
            r.on_complete(req.request_id, now=float(n))
            scales.append(r.band.scale)
        assert all(0.5 <= s <= 2.0 for s in scales)


def test_never_routes_beyond_the_hard_limit() -> None:
    hard = 1.5
    r = router(tuning=BandTuning(hard_rel=hard, hard_request_share=1.0, min_scale=1.0, max_scale=64.0))
    assert isinstance(r, SelfTuningRouter)
    limit_cost = CostModel(balance_rel=hard, balance_request_share=1.0)
    candidates = [Candidate(i) for i in range(REPLICAS)]
    requests = hot_prefix(6)
    for n, req in enumerate(requests):  # nothing completes: load only grows, the hot prefix pulls to one replica
        now = float(n)
        decision = r.route(req, candidates, now=now)
        bounds = limit_cost.scores(
            [(c.replica, decision.match, r.load(c.replica, c, now=now), 1) for c in candidates],
            prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens, tokens_per_block=TPB)
        assert next(s for s in bounds if s.replica == decision.replica).excess_load <= 0
        r.on_dispatch(req, decision, now=now)


def greedy_opening(controller: BandController, sizes: list[int]) -> list[float]:
    """Each dispatch to the replica with the least prefill so far (the most even placement there is);
    returns the scale after each."""
    totals = dict.fromkeys(controller.weights, 0)
    scales = []
    for size in sizes:
        replica = min(totals, key=lambda r: (totals[r], r))
        totals[replica] += size
        controller.record(replica, size)
        scales.append(controller.scale)
    return scales


def test_forgives_the_coarse_opening_but_not_a_pile_up() -> None:
    """8 replicas, long and short first prompts placed as evenly as possible: the raw measure reads
    above the target for want of dispatches (one long prompt is a large part of a replica's share), so the
    plain controller tightens; forgiving one dispatch holds the fixed defaults. Everything on one replica
    is tightened either way."""
    sizes = [8000 if n % 3 == 0 else 1000 for n in range(40)]
    opened = {}
    for forgive in (0.0, 1.0):
        c = BandController(BandTuning(window=1, warmup_per_replica=1, forgive=forgive))
        c.weights = {r: 1 for r in range(8)}
        opened[forgive] = greedy_opening(c, sizes)
        assert c.imbalance() > 1.15  # the raw measure never reads even enough to widen
    assert min(opened[0.0]) < 1.0
    assert all(s >= 1.0 for s in opened[1.0])
    piled = BandController(BandTuning(window=1, warmup_per_replica=1, forgive=1.0))
    piled.weights = {r: 1 for r in range(8)}
    for size in sizes:
        piled.record(0, size)
    assert piled.scale == piled.tuning.min_scale


def test_a_fading_allowance_forgives_the_opening_and_then_tightens_like_the_plain_controller() -> None:
    """2 replicas, a 20K-token dispatch every 40th (to replica 1) and small ones two to one on replica 0:
    the raw measure sits at 1.26–1.38 for the whole run. Forgiving 3 of the largest dispatches for good
    holds the fixed defaults throughout; fading the allowance with each replica's dispatch count
    tightens as the plain controller does. In the coarse opening (8 replicas, ~5 dispatches each) the
    fading allowance still forgives."""

    def run(forgive: float, fade: float) -> BandController:
        c = BandController(BandTuning(forgive=forgive, forgive_fade=fade))
        c.weights = {0: 1, 1: 1}
        for i in range(600):
            c.record(1, 20000) if i % 40 == 0 else c.record(0 if i % 3 else 1, 600)
            if i >= 100:
                assert 1.25 < c.imbalance() < 1.4
        return c

    assert run(3.0, 0.0).scale >= 1.0
    assert run(3.0, 4.0).scale == run(0.0, 0.0).scale == BandTuning().min_scale
    sizes = [8000 if n % 3 == 0 else 1000 for n in range(40)]
    c = BandController(BandTuning(window=1, warmup_per_replica=1, forgive=1.0, forgive_fade=4.0))
    c.weights = {r: 1 for r in range(8)}
    assert all(s >= 1.0 for s in greedy_opening(c, sizes))


def test_a_forgive_limit_tightens_on_the_raw_measure_whatever_is_forgiven() -> None:
    """The run of the previous test with a constant allowance of 3 dispatches (which holds the fixed
    defaults throughout): with a limit on the raw measure below where it sits (1.26–1.38 after the first
    hundred dispatches, up to 1.71 before), the controller tightens
    as the plain one does; with a limit above it, the allowance still holds the defaults."""

    def run(limit: float) -> BandController:
        c = BandController(BandTuning(forgive=3.0, forgive_limit=limit))
        c.weights = {0: 1, 1: 1}
        for i in range(600):
            c.record(1, 20000) if i % 40 == 0 else c.record(0 if i % 3 else 1, 600)
        return c

    assert run(0.0).scale >= 1.0
    assert run(1.8).scale >= 1.0
    assert run(1.25).scale == BandTuning().min_scale


def test_a_squared_fade_catches_the_pile_up_a_linear_fade_of_the_same_length_forgives() -> None:
    """The 2-replica run above with forgive 8 fading after 16 dispatches: fading as 1 / n_r still
    forgives enough of the 20K dispatches to hold the fixed defaults; fading as (16 / n_r)² tightens
    to the floor. Both still forgive the coarse 8-replica opening."""

    def run(power: float) -> BandController:
        c = BandController(BandTuning(forgive=8.0, forgive_fade=16.0, forgive_fade_power=power))
        c.weights = {0: 1, 1: 1}
        for i in range(600):
            c.record(1, 20000) if i % 40 == 0 else c.record(0 if i % 3 else 1, 600)
        return c

    assert run(1.0).scale >= 1.0
    assert run(2.0).scale == BandTuning().min_scale
    sizes = [8000 if n % 3 == 0 else 1000 for n in range(40)]
    for power in (1.0, 2.0):
        c = BandController(BandTuning(window=1, warmup_per_replica=1, forgive=8.0, forgive_fade=4.0,
                                      forgive_fade_power=power))
        c.weights = {r: 1 for r in range(8)}
        assert all(s >= 1.0 for s in greedy_opening(c, sizes))


def test_scaled_band() -> None:
    base = CostModel()
    wide, tight = scaled(base, 4.0), scaled(base, 0.5)
    rel = base.balance_rel - 1.0  # the band's relative part scales, around 1
    assert wide.balance_request_share == 4.0 and wide.balance_rel == pytest.approx(1.0 + 4 * rel) and wide.load_weight == 1.0
    assert tight.balance_request_share == 0.5 and tight.balance_rel == pytest.approx(1.0 + rel / 2) and tight.load_weight == 2.0
    assert scaled(CostModel(balance_rel=1.5), 4.0).balance_rel == pytest.approx(3.0)


@pytest.mark.parametrize("knobs", [{"target": 0.9}, {"step": 1.0}, {"min_scale": 2.0}, {"max_scale": 0.5},
                                   {"window": 0}, {"hard_rel": 0.5}, {"half_life": 0.0},
                                   {"forgive": -1.0}, {"forgive_fade": -1.0},
                                   {"forgive_limit": 1.1}, {"forgive_limit": -1.0},
                                   {"forgive_fade_power": 0.5}])
def test_bad_knobs_are_refused(knobs: dict) -> None:
    with pytest.raises(RoutingError):
        BandTuning(**knobs)


def test_follows_the_cache_where_the_fixed_band_gives_reuse_away() -> None:
    """The api family (single-turn requests behind shared system prompts), 4 replicas × 2 % GPU, host 4×:
    the fixed band moves some of a prompt's followers off its replica; the self-tuning band widens and
    keeps them, within the 1.3 imbalance the benchmarks hold routing to. With a prompt's blocks reusable
    from the end of its prefill (as TensorRT-LLM stores them) rather than from its request's end, most of
    the followers find them anyway: the band's gain here fell from over a point to a few tenths."""
    import json

    from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig
    from retention.trace import distinct_blocks, parse_trace
    from retention.workloads import families

    family = next(f for f in families() if f.name == "api")
    trace = parse_trace([json.dumps(x) for x in family.generate(0)])[:300]
    gpu = round(distinct_blocks(trace) * 0.02)
    results = {
        name: simulate_cluster(trace, lambda: make_policy("trtllm-default"), cluster=ClusterConfig(4, name),
                               primary_blocks=gpu, secondary_blocks=4 * gpu, config=SimConfig(hold="tokens"))
        for name in ("kv-aware", "kv-adaptive")
    }
    fixed, adaptive = results["kv-aware"], results["kv-adaptive"]
    assert adaptive.total.hit_rate > fixed.total.hit_rate + 0.002
    assert adaptive.load_imbalance <= 1.3


def test_kv_adaptive_is_a_router_name() -> None:
    from retention.routing import ROUTER_NAMES

    assert "kv-adaptive" in ROUTER_NAMES
    r = make_router("kv-adaptive", tokens_per_block=TPB, tuning=BandTuning(target=1.1))
    assert isinstance(r, SelfTuningRouter) and r.band.tuning.target == 1.1
    decision = r.route(RouteRequest(0, (1, 2, 3), 3 * TPB + 1, 4), [Candidate(0), Candidate(1)], now=0.0)
    assert decision.router == "kv-adaptive"


def test_bounded_scale_keeps_chat_sessions_where_the_wide_bounds_scatter_them() -> None:
    """The chat family (a tune family: multi-turn sessions over four shared system prompts), 8 replicas,
    GPU at the floor (the largest request), host 0, arrival ×4 — one of the tune grid's settings: with the
    default bounds [¼, 64] the scale swings from the cache-only cost to a band that scatters sessions;
    bounded to [½, 4] (``kv-adaptive, bounded`` in docs/benchmarks.md, "Routing that generalizes") it keeps
    more of the sessions' reuse: about two points with prompts reusable from the end of their prefill, as
    TensorRT-LLM stores them. Under that rule its imbalance here is 1.38 against the wide bounds' 1.16, above
    the 1.3 the benchmarks hold routing to (it was within it when prompts were reusable only from their
    request's end): a trade-off, and a reason it is a reported variant, not the default."""
    import dataclasses
    import json

    from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig
    from retention.trace import parse_trace
    from retention.workloads import families

    family = next(f for f in families() if f.name == "chat")
    trace = parse_trace([json.dumps(x) for x in family.generate(0)])[:300]
    trace = [dataclasses.replace(r, timestamp_ms=r.timestamp_ms / 4) for r in trace]
    gpu = max(-(-(r.input_length + r.output_length) // 512) for r in trace)
    # the cost the bounds were chosen over: the kv-aware defaults of that time (queued prefill at the prefill's
    # weight, 0.1 × decode blocks, 0.2 × recent work, band ×1.5), pinned so the comparison stays the one made
    cost = CostModel(queue_weight=None, decode_weight=0.1, recent_weight=0.2, balance_rel=1.5)
    results = {
        name: simulate_cluster(trace, lambda: make_policy("lru"),
                               cluster=ClusterConfig(8, "kv-adaptive", cost=cost, tuning=tuning),
                               primary_blocks=gpu, secondary_blocks=0, config=SimConfig(hold="tokens"))
        for name, tuning in (("bounded", BandTuning(min_scale=0.5, max_scale=4.0)), ("default", BandTuning()))
    }
    bounded, wide = results["bounded"], results["default"]
    assert bounded.total.hit_rate > wide.total.hit_rate + 0.01
