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


def _plan_at(ledger: HintLedger, now: float, hashes: list[int], hints: CacheHints = AGENT, *, tpb: int = 16):
    return plan_with_hints(base(), hints, ON, total=128, tokens_per_block=tpb, hashes=hashes, ledger=ledger,
                           tenant="t", budget_blocks=1000, now=now)


FIVE_MIN = CacheHints(breakpoints=(Breakpoint(112, TTL_5M_MS),))
ONE_HOUR = CacheHints(breakpoints=(Breakpoint(112, TTL_1H_MS),))


def _released(ledger: HintLedger, out, now: float) -> None:
    """The request ends at ``now`` (the gateway records its hinted blocks again)."""
    ledger.record("t", out.hashes, out.durations_ms, now, windows_ms=out.windows_ms)


def test_the_hold_is_the_ttl_until_enough_reuse_gaps_are_measured_then_follows_them():
    ledger = HintLedger()
    hashes = [1000 + i for i in range(8)]
    first = _plan_at(ledger, 0.0, hashes)
    assert set(first.durations_ms) == {TTL_1H_MS, TTL_5M_MS}  # nothing measured yet: the client's TTLs
    assert first.windows_ms == first.durations_ms
    now = 0.0
    for _ in range(hint_quota.MIN_GAP_SAMPLES):  # the prompt comes back every 4 s: one gap per request
        now += 4.0
        out = _plan_at(ledger, now, hashes)
    assert ledger.gap_count("t", TTL_5M_MS) == hint_quota.MIN_GAP_SAMPLES
    hold = int(hint_quota.GAP_MARGIN * 4.0 * 1000)
    # The gaps are those of the deepest reused block, hinted 5 min: they measure the 5 min
    # class only; the 1 h prefix keeps the client's TTL (no 1 h evidence).
    assert out.durations_ms == (TTL_1H_MS,) * 4 + (hold,) * 3
    assert set(out.windows_ms) == {TTL_1H_MS, TTL_5M_MS}  # the window stays the client's
    assert TokenRange(96, 112, 60, hold) in out.plan.ranges  # the engine is told the hold (the class keeps 60/600 s)
    assert ledger.hold_ms("t", 1_000) == 1_000  # never longer than what the client asked
    assert ledger.hold_ms("u", TTL_5M_MS) == TTL_5M_MS  # another tenant's gaps are its own


def test_a_dead_hinted_block_stops_counting_against_the_budget_after_the_hold_not_the_ttl():
    ledger = HintLedger()
    hashes = [2000 + i for i in range(8)]
    now = 0.0
    for _ in range(hint_quota.MIN_GAP_SAMPLES + 1):
        now += 2.0
        _plan_at(ledger, now, hashes, FIVE_MIN)
    assert ledger.live_blocks("t", now) == 7
    # The run ends: nothing comes back. After 2 x 2 s the blocks are no longer held at the
    # hinted priority (the engine reverts them to 35), although the 5 min window is open.
    assert ledger.live_blocks("t", now + 4.5) == 0
    # Gaps are measured within the client's window, so a late return is still counted (no censoring).
    late = now + 30.0
    _plan_at(ledger, late, hashes, FIVE_MIN)
    assert max(ledger._tenants["t"].gaps["5m"]) == pytest.approx(30.0)


def test_a_single_repeat_of_a_long_prompt_keeps_the_clients_ttl():
    # One request reusing 28 hinted blocks is one gap, not 28: a prompt sent again once (a
    # client's second turn, a retry after an overload) never turns a 1 h hint into a short hold.
    ledger = HintLedger()
    hashes = [3000 + i for i in range(32)]  # 4-token blocks: 28 of them hinted
    for start, back in ((0.0, 60.0), (1_000.0, 1.5)):
        hashes = [h + 100 for h in hashes]
        first = _plan_at(ledger, start, hashes, ONE_HOUR, tpb=4)
        _released(ledger, first, start + 0.2)
        again = _plan_at(ledger, start + 0.2 + back, hashes, ONE_HOUR, tpb=4)
        assert again.durations_ms == (TTL_1H_MS,) * 28
        assert TokenRange(32, 112, 60, TTL_1H_MS) in again.plan.ranges  # (the class pins the system 90/∞)
    assert ledger.gap_count("t", TTL_1H_MS) == 2


def test_sixteen_distinct_requests_with_short_gaps_shorten_the_hold_and_not_one_fewer():
    ledger = HintLedger()
    hashes = [4000 + i for i in range(8)]
    now = 0.0
    _plan_at(ledger, now, hashes, ONE_HOUR)
    for n in range(1, hint_quota.MIN_GAP_SAMPLES + 1):
        now += 5.0
        out = _plan_at(ledger, now, hashes, ONE_HOUR)
        if n < hint_quota.MIN_GAP_SAMPLES:
            assert out.durations_ms == (TTL_1H_MS,) * 7, n  # 15 requests are not enough evidence
    assert out.durations_ms == (int(hint_quota.GAP_MARGIN * 5.0 * 1000),) * 7


def test_retries_within_a_second_are_not_gaps():
    ledger = HintLedger()
    hashes = [5000 + i for i in range(8)]
    now = 0.0
    for _ in range(4 * hint_quota.MIN_GAP_SAMPLES):  # sent again 0.4 s after each answer ends
        out = _plan_at(ledger, now, hashes, ONE_HOUR)
        _released(ledger, out, now + 0.1)
        now += 0.5
    assert out.durations_ms == (TTL_1H_MS,) * 7
    assert ledger.gap_count("t", TTL_1H_MS) == 0
    # A real return after the retries is a gap, measured from the last release.
    _plan_at(ledger, now - 0.4 + 30.0, hashes, ONE_HOUR)
    assert list(ledger._tenants["t"].gaps["1h"]) == [pytest.approx(30.0)]


def test_fast_5m_repeats_never_shorten_1h_hints():
    ledger = HintLedger()
    now = 0.0
    five = [6000 + i for i in range(8)]
    for _ in range(2 * hint_quota.MIN_GAP_SAMPLES):  # one dialect's 5 min hints, back every 2 s
        now += 2.0
        short = _plan_at(ledger, now, five, FIVE_MIN)
    assert short.durations_ms == (4_000,) * 7  # the 5 min class is measured ...
    hour = [7000 + i for i in range(8)]
    out = _plan_at(ledger, now, hour, ONE_HOUR)
    assert out.durations_ms == (TTL_1H_MS,) * 7  # ... the 1 h class is not: its hints keep their TTL
    again = _plan_at(ledger, now + 2.0, hour, ONE_HOUR)
    assert again.durations_ms == (TTL_1H_MS,) * 7
    assert ledger.hold_ms("t", TTL_1H_MS) == TTL_1H_MS
    assert ledger.gap_count("t", TTL_1H_MS) == 1


def test_a_prefix_that_waited_long_is_held_at_least_that_long():
    # The class's gaps say "back within seconds", but this request's own prefix just came back
    # after 10 min: the evidence for it is 10 min, so it is held for 2 x 10 min (within 1 h).
    ledger = HintLedger()
    hashes = [8000 + i for i in range(8)]
    now = 0.0
    for _ in range(hint_quota.MIN_GAP_SAMPLES + 1):
        now += 3.0
        _plan_at(ledger, now, hashes, ONE_HOUR)
    assert ledger.hold_ms("t", TTL_1H_MS) == 6_000
    slow = [9000 + i for i in range(8)]
    _plan_at(ledger, now, slow, ONE_HOUR)
    back = _plan_at(ledger, now + 600.0, slow, ONE_HOUR)
    assert back.durations_ms == (1_200_000,) * 7


def _reader(ledger: HintLedger, now: float, *, hints: CacheHints = CacheHints(), policy: HintPolicy = ON):
    """A request of the same tenant over the same prompt: its own hints (none by default), then keep_pins."""
    hashes = [1000 + i for i in range(128 // 16)]
    pins = ledger.pins("t", hashes, now)
    own = plan_with_hints(base(), hints, policy, total=128, tokens_per_block=16, hashes=hashes, ledger=ledger,
                          tenant="t", budget_blocks=1000, now=now)
    return hint_quota.keep_pins(own, pins, policy, total=128, tokens_per_block=16, hashes=hashes, ledger=ledger,
                                tenant="t", now=now)


def test_a_read_without_hints_keeps_an_earlier_hint_for_the_rest_of_its_hold():
    # TensorRT-LLM gives a reused block the last request's priority: without the pins kept, this
    # read would send the class's 60/10 min and 35/30 s over blocks a client asked to keep 1 h.
    ledger = HintLedger()
    _reader(ledger, 0.0, hints=CacheHints(breakpoints=(Breakpoint(112, TTL_1H_MS),)))
    later = _reader(ledger, 600.0)
    assert later.plan.ranges[:2] == (TokenRange(0, 32, 90, None), TokenRange(32, 112, 60, TTL_1H_MS - 600_000))
    assert later.plan.retention_at(112) == base().retention_at(112)  # past the pinned blocks: the class
    assert ledger.live_blocks("t", 600.0) == 7  # the same blocks, no budget spent twice
    assert _reader(ledger, 600.0 + TTL_1H_MS).plan == base()


def test_own_hints_set_the_hold_of_what_they_cover_and_pins_keep_the_rest_until_they_run_out():
    ledger = HintLedger()
    _reader(ledger, 0.0, hints=CacheHints(breakpoints=(Breakpoint(112, TTL_1H_MS),)))
    five = _reader(ledger, 10.0, hints=CacheHints(breakpoints=(Breakpoint(64, TTL_5M_MS),)))
    # Its own 5 min hint covers [0, 64): the latest hinted use sets the hold there (the class's
    # 60/10 min context outlasts 5 min), not the earlier hour's rest.
    assert five.plan.retention_at(40) == (60, 600_000)
    assert five.plan.retention_at(100) == (60, TTL_1H_MS - 10_000)  # not covered by its own hint: the pin's rest
    gone = _reader(ledger, 10.0 + 2 * TTL_1H_MS / 1000)
    assert gone.plan == base()


def test_pins_are_kept_only_where_the_class_honours_hints_and_never_for_a_demoted_plan():
    ledger = HintLedger()
    _reader(ledger, 0.0, hints=CacheHints(breakpoints=(Breakpoint(112, TTL_1H_MS),)))
    off = _reader(ledger, 5.0, policy=HintPolicy(enabled=False))
    assert off.plan == base()
    demoted = RetentionPlan(base().ranges, base().decode_priority, base().decode_duration_ms, demoted=True)
    unhinted = hint_quota.HintedPlan(demoted)
    hashes = [1000 + i for i in range(8)]
    kept = hint_quota.keep_pins(unhinted, ledger.pins("t", hashes, 5.0), ON, total=128, tokens_per_block=16,
                                hashes=hashes, ledger=ledger, tenant="t", now=5.0)
    assert kept is unhinted


def _release(ledger: HintLedger, out: hint_quota.HintedPlan, now: float) -> None:
    """What the gateway records when the request ends (completions._finish)."""
    if out.hashes:
        ledger.record("t", out.hashes, out.durations_ms, now, windows_ms=out.windows_ms)
    if out.kept_hashes:
        ledger.record("t", out.kept_hashes, out.kept_durations_ms, now, promise=False)


def test_reads_keeping_a_pin_never_extend_its_promise():
    # Each read re-tells the engine the rest of the hold and records it at release (durations start
    # there): counted from the release, the rest would never shrink under back-to-back reads.
    ledger = HintLedger()
    first = _reader(ledger, 0.0, hints=CacheHints(breakpoints=(Breakpoint(112, TTL_5M_MS),)))
    _release(ledger, first, 1.0)
    now = 1.0
    while now < 400.0:
        out = _reader(ledger, now)
        now += 20.0  # each read takes 20 s
        _release(ledger, out, now)
    assert not ledger.pins("t", [1000 + i for i in range(8)], now) or all(
        p is None for p in ledger.pins("t", [1000 + i for i in range(8)], now))
    assert _reader(ledger, now).plan == base()
    assert ledger.live_blocks("t", now + 60.0) == 0  # the budget frees once the last re-told hold ran out


def test_a_pin_deeper_than_an_expired_one_is_still_kept():
    # A 1 h hint over seven blocks, then a 5 min one over the first four: once the 5 min are over,
    # blocks 4-6 are still promised for the hour.
    ledger = HintLedger()
    _reader(ledger, 0.0, hints=CacheHints(breakpoints=(Breakpoint(112, TTL_1H_MS),)))
    _reader(ledger, 10.0, hints=CacheHints(breakpoints=(Breakpoint(64, TTL_5M_MS),)))
    later = _reader(ledger, 10.0 + TTL_5M_MS / 1000 + 1)
    assert later.plan.retention_at(100)[0] == 60  # block 6: the hour's rest
    assert later.plan.retention_at(40) == base().retention_at(40)  # block 2: its 5 min are over
    assert later.hashes == () and set(later.kept_hashes) == {1004, 1005, 1006}
