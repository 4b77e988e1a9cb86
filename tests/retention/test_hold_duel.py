"""The conversation hold's duel: two shadows of the pool, held and not, replaying every request."""

from __future__ import annotations

from retention.policy.conversation import ConversationLedger, ConversationRequest, plan_conversation
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import MIN_GAP_SAMPLES
from retention.policy.hold_duel import HoldDuel, PoolShape
from retention.types import DEFAULT_PLAN, RetentionPlan, TokenRange

BS = 16
CAPS = HintPolicy(enabled=True, max_ttl_ms=3_600_000, max_priority=60, quota_fraction=0.5)
SHAPE = PoolShape(64)  # at most 64 GPU blocks: the shadows replay every block (sampling rate 1)
HELD = RetentionPlan((TokenRange(0, None, 60, 3_600_000),))


def blocks(first: int, n: int = 8) -> list[int]:
    return list(range(first, first + n))


def replay(duel: HoldDuel, requests: list[tuple[list[int], bool]]) -> None:
    """Each request's blocks, held in the ``always`` shadow when flagged, at one second apart."""
    for t, (hashes, held) in enumerate(requests):
        duel.record(SHAPE, hashes, DEFAULT_PLAN, HELD if held else DEFAULT_PLAN, now=float(t),
                    num_tokens=len(hashes) * BS, tokens_per_block=BS)


def test_holding_a_prefix_that_returns_after_the_pool_turned_over_wins_the_pool() -> None:
    # A conversation prefix comes back every 10 requests; between, 9 one-shot prompts of 8 blocks
    # (72 blocks) turn the 64-block pool over, so only a held prefix survives.
    duel = HoldDuel()
    stream, fresh = [], 1_000
    for _ in range(60):
        stream.append((blocks(0), True))
        for _ in range(9):
            stream.append((blocks(fresh), False))
            fresh += 8
    assert duel.arm == "never" and not duel.holds()  # no evidence, no hold
    replay(duel, stream)
    standings = duel.standings()
    assert standings["always"] > standings["never"] + 0.05
    assert duel.holds() and duel.switches == 1


def test_holding_what_never_returns_loses_to_the_unheld_pool_and_the_arm_stays_off() -> None:
    # Held one-shot prompts (a held tool step nobody continues) crowd out a shared prefix that
    # LRU alone keeps: it returns every 4 requests, well inside the pool's reach.
    duel = HoldDuel()
    stream, fresh = [], 1_000
    for _ in range(150):
        stream.append((blocks(0), False))
        for _ in range(3):
            stream.append((blocks(fresh), True))
            fresh += 8
    replay(duel, stream)
    standings = duel.standings()
    assert standings["never"] > standings["always"]
    assert not duel.holds() and duel.switches == 0


def test_the_shadows_see_every_request_and_the_always_arm_spends_its_own_budget() -> None:
    ledger = ConversationLedger(duel=HoldDuel())
    now = 0.0

    def step(rid: str, previous: str | None, first_hash: int, t: float):  # noqa: ANN202
        return plan_conversation(DEFAULT_PLAN, ConversationRequest(rid, previous, True, True), CAPS, total=4 * BS + 3,
                                 output_tokens=2 * BS, tokens_per_block=BS, hashes=blocks(first_hash, 4), ledger=ledger,
                                 tenant="t", budget_blocks=1_000, now=t, store_ttl_ms=3_600_000, shape=SHAPE)

    for i in range(MIN_GAP_SAMPLES + 1):  # measured gaps (the stream, whatever the arm)
        step(f"w{i}a", None, 10_000 + 100 * i, now)
        step(f"w{i}b", f"w{i}a", 10_000 + 100 * i, now + 3.0)
        now += 1_000.0
    out = step("x", None, 500, now)
    assert out.hold_ms == 0 and out.plan is DEFAULT_PLAN  # the arm is "never": nothing held for real ...
    assert ledger.holds.live_blocks("t", now) == 0
    assert ledger.duel.budget.live_blocks("t", now) > 0  # ... while the always shadow held what the budget allowed
    plain = plan_conversation(DEFAULT_PLAN, ConversationRequest(), CAPS, total=4 * BS, output_tokens=BS,
                              tokens_per_block=BS, hashes=blocks(900, 4), ledger=ledger, tenant="u",
                              budget_blocks=1_000, now=now, store_ttl_ms=3_600_000, shape=SHAPE)
    assert plain.plan is DEFAULT_PLAN
    for shadow in ledger.duel.duel.shadows:  # every request, held or not, in both shadows
        assert shadow.counts.requests == 2 * (MIN_GAP_SAMPLES + 1) + 2


def test_without_a_duel_every_eligible_request_is_held() -> None:
    ledger = ConversationLedger(duel=None)
    now = 0.0

    def step(rid: str, previous: str | None, first_hash: int, t: float):  # noqa: ANN202
        return plan_conversation(DEFAULT_PLAN, ConversationRequest(rid, previous, True, True), CAPS, total=4 * BS + 3,
                                 output_tokens=2 * BS, tokens_per_block=BS, hashes=blocks(first_hash, 4), ledger=ledger,
                                 tenant="t", budget_blocks=1_000, now=t, store_ttl_ms=3_600_000)

    for i in range(MIN_GAP_SAMPLES + 1):
        step(f"w{i}a", None, 10_000 + 100 * i, now)
        step(f"w{i}b", f"w{i}a", 10_000 + 100 * i, now + 3.0)
        now += 1_000.0
    assert all(step(f"x{i}", None, 100 * i, now).hold_ms == 3_000 for i in range(20))


def test_a_resized_pool_starts_a_new_contest_on_shadows_of_its_new_shape() -> None:
    duel = HoldDuel()
    replay(duel, [(blocks(0), True)] * 5)
    first = duel.duel
    assert first is not None and first.shadows[0].counts.requests == 5
    duel.record(PoolShape(128), blocks(0), DEFAULT_PLAN, HELD, now=10.0, num_tokens=8 * BS, tokens_per_block=BS)
    assert duel.duel is not first and duel.shape == PoolShape(128)
    assert duel.duel.shadows[0].counts.requests == 1 and duel.arm == "never"
