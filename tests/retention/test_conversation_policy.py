"""The conversation and tool-loop hold: measured gaps, bounded by the class, a delete releases only by not renewing."""

from __future__ import annotations

import pytest

from retention.policy.conversation import (
    ConversationLedger,
    ConversationRequest,
    decode_keys,
    plan_conversation,
)
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import MIN_GAP_SAMPLES
from retention.types import DEFAULT_PLAN, RetentionPlan, TokenRange

BS = 16
CAPS = HintPolicy(enabled=True, max_ttl_ms=3_600_000, max_priority=60, quota_fraction=0.5)
STORE_TTL = 30 * 24 * 3600 * 1000


def step(ledger: ConversationLedger, rid: str, previous: str | None, now: float, *, tools: bool = True,
         blocks: int = 4, caps: HintPolicy = CAPS, budget: int = 1_000, base: RetentionPlan = DEFAULT_PLAN,
         output: int = 2 * BS, first_hash: int = 0):  # noqa: ANN201
    hashes = list(range(first_hash, first_hash + blocks))
    return plan_conversation(base, ConversationRequest(rid, previous, True, tools), caps, total=blocks * BS + 3,
                             output_tokens=output, tokens_per_block=BS, hashes=hashes, ledger=ledger, tenant="t",
                             budget_blocks=budget, now=now, store_ttl_ms=STORE_TTL)


def warm(ledger: ConversationLedger, gap: float, *, tools: bool = True, runs: int = MIN_GAP_SAMPLES + 1) -> float:
    """Chains of two responses ``gap`` seconds apart (each continuation one measured gap); returns the clock."""
    now = 0.0
    for i in range(runs):
        step(ledger, f"w{i}a", None, now, tools=tools, first_hash=10_000 + 100 * i)
        now += gap
        step(ledger, f"w{i}b", f"w{i}a", now, tools=tools, first_hash=10_000 + 100 * i)
        now += 1000.0  # far apart: the warm-up's holds have run out
    return now


def test_no_hold_before_gaps_are_measured() -> None:
    out = step(ConversationLedger(duel=None), "r1", None, 0.0)
    assert out.plan is DEFAULT_PLAN and out.kind == "tool" and out.hold_ms == 0


def test_a_tool_loop_is_held_for_its_measured_median_gap_prompt_and_decode() -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    assert ledger.gap_count("t", "tool") == MIN_GAP_SAMPLES + 1 and ledger.gap_count("t", "turn") == 0
    out = step(ledger, "r1", None, now)
    assert out.hold_ms == 3_000 and out.held_blocks == 4 and out.decode_held
    assert out.plan.ranges == (TokenRange(0, 4 * BS, 60, 3_000), TokenRange(4 * BS, None, 35, None))
    assert (out.plan.decode_priority, out.plan.decode_duration_ms) == (60, 3_000)


def test_turn_gaps_and_tool_gaps_are_measured_apart() -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    now = warm(ledger, 40.0, tools=False) + now
    assert step(ledger, "c1", None, now, tools=False).hold_ms == 40_000
    assert step(ledger, "a1", None, now, tools=True).hold_ms == 3_000


def test_the_hold_never_exceeds_the_class_caps() -> None:
    caps = HintPolicy(enabled=True, max_ttl_ms=10_000, max_priority=50)
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 600.0)  # gaps of 10 min, class allows 10 s
    out = step(ledger, "r1", None, now, caps=caps)
    assert out.hold_ms == 10_000
    for rng in out.plan.ranges:
        assert rng.priority <= 50 and (rng.duration_ms is None or rng.duration_ms <= 10_000)
    assert out.plan.decode_priority == 50 and out.plan.decode_duration_ms == 10_000


@pytest.mark.parametrize("caps", [HintPolicy(enabled=False), CAPS])
def test_off_class_or_plain_request_or_demoted_plan_keeps_the_same_plan(caps: HintPolicy) -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    demoted = RetentionPlan((TokenRange(0, None, 10, None),), demoted=True)
    if not caps.enabled:
        assert step(ledger, "x", None, now, caps=caps).plan is DEFAULT_PLAN
    assert step(ledger, "y", None, now, base=demoted).plan is demoted
    plain = plan_conversation(DEFAULT_PLAN, ConversationRequest(), caps, total=70, output_tokens=16, tokens_per_block=BS,
                              hashes=[1, 2, 3, 4], ledger=ledger, tenant="t", budget_blocks=100, now=now,
                              store_ttl_ms=STORE_TTL)
    assert plain.plan is DEFAULT_PLAN and plain.kind is None


def test_a_hold_only_strengthens_the_base_plan() -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    base = RetentionPlan((TokenRange(0, BS, 90, None), TokenRange(BS, None, 35, 30_000)), 80, None)
    out = step(ledger, "r1", None, now, base=base)
    assert out.plan.retention_at(0) == (90, None)  # a pinned system prompt stays pinned
    assert out.plan.retention_at(BS) == (60, 3_000)
    assert (out.plan.decode_priority, out.plan.decode_duration_ms) == (80, None)  # decode above the hold stays


def test_the_budget_clips_the_hold_and_then_no_decode_retention() -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    out = step(ledger, "r1", None, now, budget=3, first_hash=500)
    assert out.clipped and out.held_blocks == 3 and not out.decode_held
    assert out.plan.retention_at(2 * BS) == (60, 3_000) and out.plan.retention_at(3 * BS)[0] == 35
    assert out.plan.decode_priority == 35
    assert ledger.holds.live_blocks("t", now) <= 3


def test_a_delete_stops_renewal_but_cannot_shorten_what_the_engine_was_given() -> None:
    ledger = ConversationLedger(duel=None)
    now = warm(ledger, 3.0)
    first = step(ledger, "r1", None, now, first_hash=700)
    live = ledger.holds.live_blocks("t", now)
    assert ledger.delete("t", "r1") and not ledger.delete("t", "r1") and ledger.deleted == 1
    # Still counted while the engine holds it (the duration was set at enqueue) ...
    assert ledger.holds.live_blocks("t", now + 1.0) == live
    # ... a continuation of the deleted response measures nothing (it cannot be continued) ...
    gaps = ledger.gap_count("t", "tool")
    assert ledger.continued("t", "r1", now + 2.0) is None and ledger.gap_count("t", "tool") == gaps
    # ... and the hold runs out on the engine's clock.
    assert ledger.holds.live_blocks("t", now + first.hold_ms / 1000 + 0.001) == 0


def test_an_expired_stored_response_measures_no_gap() -> None:
    ledger = ConversationLedger(duel=None)
    plan_conversation(DEFAULT_PLAN, ConversationRequest("r1", None, True, False), CAPS, total=40, output_tokens=1,
                      tokens_per_block=BS, hashes=[1, 2], ledger=ledger, tenant="t", budget_blocks=10, now=0.0,
                      store_ttl_ms=5_000)
    assert ledger.remaining_ms("t", "r1", 1.0) == 4_000
    assert ledger.continued("t", "r1", 6.0) is None and ledger.remaining_ms("t", "r1", 6.0) is None


def test_tenants_never_see_each_others_responses() -> None:
    ledger = ConversationLedger(duel=None)
    ledger.stored("a", "r1", tools=True, now=0.0, store_ttl_ms=STORE_TTL)
    assert ledger.continued("b", "r1", 1.0) is None and not ledger.delete("b", "r1")
    assert ledger.continued("a", "r1", 1.0) == 1.0


def test_same_inputs_same_plans() -> None:
    def replay() -> list[RetentionPlan]:
        ledger = ConversationLedger(duel=None)
        now = warm(ledger, 2.5)
        return [step(ledger, f"r{i}", f"r{i - 1}" if i else None, now + 2.0 * i, budget=7, first_hash=900).plan
                for i in range(6)]

    assert replay() == replay()
    assert decode_keys([1, 2, 3], 2) == decode_keys([1, 2, 3], 2) and len(set(decode_keys([1, 2, 3], 4))) == 4
