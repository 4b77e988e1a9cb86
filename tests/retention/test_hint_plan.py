"""Client hints → plan, within the class: the mapping, the caps, the quota share, no-op identity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.policy.hint_plan import HintPolicy, HintSpan, apply_hints, hint_spans
from retention.policy import hint_quota
from retention.policy.hint_quota import HintLedger, plan_with_hints
from retention.policy.hints import TTL_1H_MS, TTL_5M_MS, Breakpoint, CacheHints
from retention.policy.planner import QuotaState, RetentionClassSpec, SegmentRetention, Segments, plan_retention
from retention.types import RetentionPlan, RetentionPlanError, TokenRange

CLASS = RetentionClassSpec(SegmentRetention(90, None), SegmentRetention(60, 600_000), SegmentRetention(35, 30_000),
                           SegmentRetention(35, 30_000))
SEG = Segments(system_end=32, context_end=96, total=128)
ON = HintPolicy(enabled=True, max_ttl_ms=TTL_1H_MS, max_priority=60, quota_fraction=0.5)
AGENT = CacheHints(breakpoints=(Breakpoint(64, TTL_1H_MS), Breakpoint(112, TTL_5M_MS)))


def base() -> RetentionPlan:
    return plan_retention(CLASS, SEG, offload_min_priority=30)


def hinted(hints: CacheHints, policy: HintPolicy = ON, *, plan: RetentionPlan | None = None, budget: int = 1000,
           ledger: HintLedger | None = None, tenant: str = "t", total: int = 128, tpb: int = 16):
    plan = base() if plan is None else plan
    hashes = [1000 + i for i in range(total // tpb)]
    return plan_with_hints(plan, hints, policy, total=total, tokens_per_block=tpb, hashes=hashes,
                           ledger=ledger or HintLedger(), tenant=tenant, budget_blocks=budget, now=0.0)


def test_breakpoints_map_to_ranges_with_capped_ttls_and_the_class_priority():
    plan = hinted(AGENT).plan
    assert plan.ranges == (
        TokenRange(0, 32, 90, None),          # the class pins the system prompt higher: kept
        TokenRange(32, 64, 60, TTL_1H_MS),    # context 60/10 min, hinted 1 h at 60: the longer wins
        TokenRange(64, 96, 60, 600_000),      # context 60/10 min, hinted 5 min: the class's longer stays
        TokenRange(96, 112, 60, TTL_5M_MS),   # turn 35/30 s raised to 60/5 min
        TokenRange(112, None, 35, 30_000),    # after the last breakpoint: the class
    )
    assert plan.decode_priority == 35 and plan.decode_duration_ms == 30_000


def test_ttl_and_priority_are_capped_by_the_class():
    policy = HintPolicy(enabled=True, max_ttl_ms=TTL_5M_MS, max_priority=50)
    plan = hinted(CacheHints(breakpoints=(Breakpoint(128, TTL_1H_MS),)), policy).plan
    assert plan.ranges == (TokenRange(0, 32, 90, None), TokenRange(32, 96, 60, 600_000),
                           TokenRange(96, None, 50, TTL_5M_MS))
    assert max(r.priority for r in plan.ranges if r.start >= 96) == 50


def test_24h_takes_the_longest_the_class_allows_on_the_whole_prompt_and_in_memory_is_the_class_default():
    plan = hinted(CacheHints(retention="24h")).plan
    assert plan.ranges == (TokenRange(0, 32, 90, None), TokenRange(32, None, 60, TTL_1H_MS))
    same = hinted(CacheHints(retention="in_memory", cache_key="conv-1"))
    assert same.plan == base()
    assert same.hashes == ()


@pytest.mark.parametrize("hints,policy", [
    (CacheHints(), ON),
    (AGENT, HintPolicy(enabled=False)),
    (CacheHints(cache_key="k"), ON),
    (CacheHints(retention="in_memory"), ON),
])
def test_no_hint_or_a_class_that_forbids_them_gives_the_identical_plan(hints, policy):
    plan = base()
    out = hinted(hints, policy, plan=plan)
    assert out.plan is plan and out.hashes == ()


def test_over_quota_demotion_wins():
    demoted = plan_retention(CLASS, SEG, offload_min_priority=30, quota=QuotaState(over_quota=True))
    out = hinted(CacheHints(retention="24h"), plan=demoted)
    assert out.plan is demoted and out.plan.ranges == (TokenRange(0, None, 0, None),)


def test_the_quota_share_cuts_the_hint_at_a_block_and_counts_live_blocks_once():
    ledger = HintLedger()
    first = hinted(CacheHints(retention="24h"), budget=5, ledger=ledger)
    assert first.clipped and len(first.hashes) == 5
    assert first.plan.ranges[1:] == (TokenRange(32, 80, 60, TTL_1H_MS), TokenRange(80, 96, 60, 600_000),
                                     TokenRange(96, None, 35, 30_000))  # from block 5 on: the class
    again = hinted(CacheHints(retention="24h"), budget=5, ledger=ledger)
    assert again.hashes == first.hashes  # the same prefix costs nothing more
    other = hinted(CacheHints(retention="24h"), budget=5, ledger=ledger, tenant="u")
    assert len(other.hashes) == 5  # another tenant's ledger entries never count against this one
    assert ledger.live_blocks("t", now=TTL_1H_MS / 1000 + 1) == 0  # expired after the hinted duration


def test_no_room_left_leaves_the_plan_alone():
    ledger = HintLedger()
    ledger.record("t", [1, 2, 3], [TTL_1H_MS] * 3, now=0.0)
    plan = base()
    out = hinted(CacheHints(retention="24h"), plan=plan, budget=3, ledger=ledger)
    assert out.plan is plan and out.clipped


def test_partial_tail_block_keeps_the_class_retention():
    out = hinted(CacheHints(retention="24h"), total=120)  # 7 full blocks of 16, a partial 8th
    assert out.plan.ranges[-1].start == 112 and out.plan.ranges[-1].priority == 35
    assert len(out.hashes) == 7


def test_policy_validation_names_the_field():
    with pytest.raises(RetentionPlanError) as err:
        HintPolicy(enabled=True, max_priority=101)
    assert err.value.field == "hint_max_priority"
    with pytest.raises(RetentionPlanError) as err:
        HintPolicy(enabled=True, quota_fraction=0)
    assert err.value.field == "hint_quota_fraction"
    with pytest.raises(RetentionPlanError):
        HintPolicy(enabled=True, max_ttl_ms=0)


def test_breakpoints_past_the_prompt_are_clipped_and_a_later_longer_ttl_extends_the_prefix():
    hints = CacheHints(breakpoints=(Breakpoint(16, TTL_5M_MS), Breakpoint(500, TTL_1H_MS)))
    assert hint_spans(hints, ON, 128) == (HintSpan(0, 16, TTL_1H_MS), HintSpan(16, 128, TTL_1H_MS))


plans = st.lists(st.tuples(st.integers(0, 100), st.one_of(st.none(), st.integers(0, 10**7))), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(parts=plans, cut=st.lists(st.integers(1, 127), max_size=4, unique=True),
       ttls=st.lists(st.integers(1, 10**8), min_size=4, max_size=4), cap=st.integers(0, 100),
       max_ttl=st.integers(1, 10**8), retention=st.sampled_from([None, "24h", "in_memory"]))
def test_hints_only_ever_strengthen_within_the_cap(parts, cut, ttls, cap, max_ttl, retention):
    bounds = sorted({0, *cut[: len(parts) - 1]})
    ranges = tuple(TokenRange(s, (bounds[i + 1] if i + 1 < len(bounds) else None), p, d)
                   for i, (s, (p, d)) in enumerate(zip(bounds, parts)))
    plan = RetentionPlan(ranges, 35, None)
    ends = sorted(set(cut))[:4]
    hints = CacheHints(breakpoints=tuple(Breakpoint(e, t) for e, t in zip(ends, ttls)), retention=retention)
    policy = HintPolicy(enabled=True, max_ttl_ms=max_ttl, max_priority=cap)
    out = apply_hints(plan, hint_spans(hints, policy, 128), policy, 128)
    for token in range(128):
        before, _ = plan.retention_at(token)
        after, duration = out.retention_at(token)
        assert before <= after <= max(before, cap)
        if after > before:
            assert duration is not None and duration <= max_ttl


def _plan_at(ledger: HintLedger, now: float, hashes: list[int], hints: CacheHints = AGENT):
    return plan_with_hints(base(), hints, ON, total=128, tokens_per_block=16, hashes=hashes, ledger=ledger,
                           tenant="t", budget_blocks=1000, now=now)


def test_the_hold_is_the_ttl_until_enough_reuse_gaps_are_measured_then_follows_them():
    ledger = HintLedger()
    hashes = [1000 + i for i in range(8)]
    first = _plan_at(ledger, 0.0, hashes)
    assert set(first.durations_ms) == {TTL_1H_MS, TTL_5M_MS}  # nothing measured yet: the client's TTLs
    assert first.windows_ms == first.durations_ms
    now = 0.0
    for _ in range(3):  # 7 hinted blocks come back every 4 s: 21 gaps of 4 s each
        now += 4.0
        out = _plan_at(ledger, now, hashes)
    hold = int(hint_quota.GAP_MARGIN * 4.0 * 1000)
    assert set(out.durations_ms) == {hold}  # min(TTL, 2 x the measured gap) for both breakpoints
    assert set(out.windows_ms) == {TTL_1H_MS, TTL_5M_MS}  # the window stays the client's
    assert TokenRange(96, 112, 60, hold) in out.plan.ranges  # the engine is told the hold (the class keeps 60/600 s)
    assert ledger.hold_ms("t", 1_000) == 1_000  # never longer than what the client asked
    assert ledger.hold_ms("u", TTL_5M_MS) == TTL_5M_MS  # another tenant's gaps are its own


def test_a_dead_hinted_block_stops_counting_against_the_budget_after_the_hold_not_the_ttl():
    ledger = HintLedger()
    hashes = [2000 + i for i in range(8)]
    now = 0.0
    for _ in range(4):
        now += 2.0
        _plan_at(ledger, now, hashes)
    assert ledger.live_blocks("t", now) == 7
    # The run ends: nothing comes back. After 2 x 2 s the blocks are no longer held at the
    # hinted priority (the engine reverts them to 35), although the 5 min window is open.
    assert ledger.live_blocks("t", now + 4.5) == 0
    # Gaps are measured within the client's window, so a late return is still counted (no censoring).
    late = now + 30.0
    _plan_at(ledger, late, hashes)
    assert max(ledger._tenants["t"].gaps) == pytest.approx(30.0)
