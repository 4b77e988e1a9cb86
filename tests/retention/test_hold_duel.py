"""Set dueling for the conversation hold: leaders by salted root id, followers follow the winner on cached shares."""

from __future__ import annotations

import pytest

from retention.policy.conversation import ConversationLedger, ConversationRequest, plan_conversation
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import MIN_GAP_SAMPLES
from retention.policy.hold_duel import HoldDuel, HoldDuelConfig
from retention.types import DEFAULT_PLAN

BS = 16
CAPS = HintPolicy(enabled=True, max_ttl_ms=3_600_000, max_priority=60, quota_fraction=0.5)
FAST = HoldDuelConfig(min_observations=8, patience=4, margin=0.01)


def feed(duel: HoldDuel, always: float, never: float, rounds: int = 64) -> None:
    """Continuations of both leader sets with the given cached shares (of 1,000 prompt tokens)."""
    for _ in range(rounds):
        duel.observe("always", int(1000 * always), 1000, continuation=True)
        duel.observe("never", int(1000 * never), 1000, continuation=True)


def test_where_holding_hurts_the_followers_switch_off() -> None:
    duel = HoldDuel(FAST, current=1)  # followers holding
    assert duel.holds("follower")
    feed(duel, always=0.40, never=0.60)
    assert duel.arm == "never" and not duel.holds("follower") and duel.switches == 1
    assert duel.holds("always") and not duel.holds("never")  # the leaders keep their arms


def test_where_holding_helps_the_followers_start_and_keep_holding() -> None:
    duel = HoldDuel(FAST)
    assert not duel.holds("follower")  # no evidence, no hold
    feed(duel, always=0.70, never=0.50)
    assert duel.holds("follower") and duel.switches == 1
    feed(duel, always=0.70, never=0.50)
    assert duel.holds("follower") and duel.switches == 1


def test_a_lead_within_the_margin_or_without_evidence_changes_nothing() -> None:
    duel = HoldDuel(FAST)
    feed(duel, always=0.505, never=0.50)  # half a point: inside the 1-point bound
    assert duel.arm == "never"
    sparse = HoldDuel(HoldDuelConfig(min_observations=1_000, patience=1))
    feed(sparse, always=0.9, never=0.1)
    assert sparse.arm == "never"


def test_only_leader_continuations_score() -> None:
    duel = HoldDuel(FAST)
    for _ in range(100):
        duel.observe("always", 1000, 1000, continuation=False)  # a first turn: nothing was held for it
        duel.observe("follower", 1000, 1000, continuation=True)
        duel.observe(None, 1000, 1000, continuation=False)
    assert duel.standings() == {"always": 0.0, "never": 0.0} and duel.arm == "never"


def test_groups_are_salted_deterministic_and_about_the_leader_share() -> None:
    duel, other = HoldDuel(), HoldDuel(HoldDuelConfig(salt="another"))
    roots = [f"resp-{i}" for i in range(4_000)]
    groups = [duel.group("t", r) for r in roots]
    assert groups == [HoldDuel().group("t", r) for r in roots]
    for name in ("always", "never"):
        assert 0.10 < groups.count(name) / len(roots) < 0.15
    assert groups != [other.group("t", r) for r in roots]
    assert duel.group("t", None) == "follower"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        HoldDuelConfig(leader_share=0.6)
    with pytest.raises(ValueError):
        HoldDuelConfig(half_life=0)


def _step(ledger, rid, previous, now, first_hash):  # noqa: ANN001, ANN202
    hashes = list(range(first_hash, first_hash + 4))
    return plan_conversation(DEFAULT_PLAN, ConversationRequest(rid, previous, True, True), CAPS, total=4 * BS + 3,
                             output_tokens=2 * BS, tokens_per_block=BS, hashes=hashes, ledger=ledger, tenant="t",
                             budget_blocks=1_000, now=now, store_ttl_ms=3_600_000)


def test_the_hold_follows_the_duel_and_a_served_continuation_scores_its_roots_set() -> None:
    ledger = ConversationLedger(duel=HoldDuel(FAST))
    duel = ledger.duel
    roots = {g: next(f"r{i}" for i in range(1_000) if duel.group("t", f"r{i}") == g) for g in ("always", "never", "follower")}
    now = 0.0
    for i in range(MIN_GAP_SAMPLES + 1):  # measured gaps (the stream, whatever the arm)
        _step(ledger, f"w{i}a", None, now, 10_000 + 100 * i)
        _step(ledger, f"w{i}b", f"w{i}a", now + 3.0, 10_000 + 100 * i)
        now += 1_000.0
    plans = {g: _step(ledger, root, None, now, 100 * n) for n, (g, root) in enumerate(roots.items())}
    assert plans["always"].hold_ms == 3_000 and plans["never"].hold_ms == 0 and plans["follower"].hold_ms == 0
    step2 = _step(ledger, roots["always"] + "-2", roots["always"], now + 3.0, 0)
    assert step2.group == "always" and step2.continuation and step2.hold_ms == 3_000  # the chain keeps its root's set
    step2.completed(ledger, 60, 67)
    assert duel.scores["always"].prompt == 67 and duel.scores["never"].prompt == 0


def test_without_a_duel_every_eligible_request_is_held() -> None:
    ledger = ConversationLedger(duel=None)
    now = 0.0
    for i in range(MIN_GAP_SAMPLES + 1):
        _step(ledger, f"w{i}a", None, now, 10_000 + 100 * i)
        _step(ledger, f"w{i}b", f"w{i}a", now + 3.0, 10_000 + 100 * i)
        now += 1_000.0
    assert all(_step(ledger, f"x{i}", None, now, 100 * i).hold_ms == 3_000 for i in range(20))
