"""The SLO guard's state machine: trip, no trip, hysteresis, cool-down, admin restore, bounds."""

from __future__ import annotations

import pytest

from retention.rollout.guard import (
    ARM_HOST,
    ARM_ROLLBACK,
    DEFAULT_MAX_OBSERVATIONS,
    GuardError,
    Observation,
    SloBudget,
    SloGuard,
    p99,
)

MAX_MIN_REQUESTS = DEFAULT_MAX_OBSERVATIONS  # the registry's bound (tenants.slo.MAX_MIN_REQUESTS)

BUDGET = SloBudget(ttft_p99_ms=500, window_seconds=10, min_requests=5, cooldown_seconds=30, hysteresis=0.2)


def feed(guard: SloGuard, start: float, stop: float, ttft: float, *, every: float = 1.0, itl: float | None = None) -> float:
    """One request per ``every`` seconds in [start, stop), evaluating after each; returns the last time."""
    t = start
    while t < stop:
        guard.observe(Observation(t, ttft, itl))
        guard.evaluate(t)
        t += every
    return t - every


def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([3.0, 1.0, 2.0]) == 3.0  # fewer than 100 values: the maximum
    assert p99([float(i) for i in range(1, 201)]) == 198.0  # ceil(0.99 * 200) = 198th value


def test_trips_after_the_budget_is_broken_for_a_whole_window():
    guard = SloGuard(BUDGET)
    # The 5th request (t=4) is the first evaluation with enough samples: the run starts there.
    last = feed(guard, 0, 14, ttft=0.8)
    assert last == 13 and not guard.tripped  # 4 + 10 = 14 not reached yet
    guard.observe(Observation(14, 0.8, None))
    transition = guard.evaluate(14)
    assert transition is not None and transition.tripped and transition.at == 14
    assert "ttft p99 800 ms > 500 ms" in transition.reason
    assert guard.tripped and guard.trips == 1


def test_one_evaluation_without_a_broken_budget_starts_the_run_over():
    guard = SloGuard(BUDGET)
    feed(guard, 0, 8, ttft=0.8)  # 8 slow requests; the run starts at t=4 (5th request)
    assert guard.state(7).breach_since == 4
    # At 13.5 the window [3.5, 13.5] holds 4 requests: too few, so not broken; the run ends.
    assert guard.evaluate(13.5) is None and guard.state(13.5).breach_since is None
    feed(guard, 14, 24, ttft=0.8)  # a new run starts at 14 (window: 4..7 and 14)
    assert not guard.tripped and guard.state(23).breach_since == 14
    guard.observe(Observation(24, 0.8, None))
    assert guard.evaluate(24).tripped


def test_no_trip_below_min_requests():
    guard = SloGuard(BUDGET)
    # One request every 3 s: at most 4 in a 10 s window, fewer than min_requests = 5.
    feed(guard, 0, 120, ttft=5.0, every=3.0)
    assert not guard.tripped and guard.trips == 0


def test_no_trip_without_budgets_or_when_disabled():
    for budget in (SloBudget(window_seconds=10, min_requests=5),
                   SloBudget(ttft_p99_ms=500, window_seconds=10, min_requests=5, enabled=False)):
        guard = SloGuard(budget)
        feed(guard, 0, 60, ttft=5.0)
        assert not guard.tripped


def test_itl_budget_trips_alone():
    guard = SloGuard(SloBudget(itl_p99_ms=50, window_seconds=5, min_requests=3, cooldown_seconds=0))
    feed(guard, 0, 20, ttft=None, itl=0.2)
    assert guard.tripped and "itl p99 200 ms > 50 ms" in guard.state(20).last_reason


def _tripped_guard() -> tuple[SloGuard, float]:
    guard = SloGuard(BUDGET)
    t = feed(guard, 0, 15, ttft=0.8)  # trips at t=14, the last request
    assert guard.tripped
    return guard, guard.state(t).since


def test_stays_tripped_during_the_cool_down_even_when_fast():
    guard, tripped_at = _tripped_guard()
    feed(guard, tripped_at + 1, tripped_at + 30, ttft=0.1)
    assert guard.tripped
    guard.observe(Observation(tripped_at + 30, 0.1, None))
    transition = guard.evaluate(tripped_at + 30)
    assert transition is not None and not transition.tripped and guard.restores == 1
    assert "<= 400 ms" in transition.reason


def test_hysteresis_keeps_it_tripped_just_under_budget():
    guard, tripped_at = _tripped_guard()
    # 450 ms is under the 500 ms budget but above 500 x (1 - 0.2) = 400 ms.
    feed(guard, tripped_at + 1, tripped_at + 100, ttft=0.45)
    assert guard.tripped
    feed(guard, tripped_at + 100, tripped_at + 106, ttft=0.39)
    assert guard.tripped  # the window still holds 450 ms requests: p99 is 450 ms
    feed(guard, tripped_at + 106, tripped_at + 112, ttft=0.39)
    assert not guard.tripped


def test_restore_needs_min_requests_after_the_cool_down():
    guard, tripped_at = _tripped_guard()
    feed(guard, tripped_at + 31, tripped_at + 100, ttft=0.1, every=3.0)  # < 5 per window
    assert guard.tripped


def test_window_is_emptied_on_trip_so_the_slow_requests_do_not_hold_the_restore_back():
    guard, tripped_at = _tripped_guard()
    assert guard.state(tripped_at).window.ttft_samples == 0


def test_admin_restore_at_once_and_only_when_tripped():
    guard, tripped_at = _tripped_guard()
    transition = guard.restore(tripped_at + 1)
    assert transition is not None and not transition.tripped and transition.reason == "restored by an admin"
    assert not guard.tripped and guard.restore(tripped_at + 2) is None
    # It can trip again: a fresh window of slow requests.
    feed(guard, tripped_at + 2, tripped_at + 20, ttft=0.8)
    assert guard.tripped and guard.trips == 2


def test_disabling_a_tripped_guard_restores_it():
    guard, tripped_at = _tripped_guard()
    assert guard.configure(BUDGET, tripped_at + 1) is None  # same settings: nothing happens
    transition = guard.configure(SloBudget(ttft_p99_ms=500, enabled=False), tripped_at + 1)
    assert transition is not None and not transition.tripped and not guard.tripped


def test_memory_is_bounded():
    guard = SloGuard(BUDGET, max_observations=100)
    for i in range(10_000):
        guard.observe(Observation(0.001 * i, 0.1, None))
    assert guard.summary(10.0).ttft_samples == 100


@pytest.mark.parametrize("kwargs, field", [
    ({"ttft_p99_ms": 0}, "ttft_p99_ms"), ({"itl_p99_ms": -1}, "itl_p99_ms"), ({"window_seconds": 0}, "window_seconds"),
    ({"min_requests": 0}, "min_requests"), ({"cooldown_seconds": -1}, "cooldown_seconds"),
    ({"hysteresis": 1.0}, "hysteresis"), ({"pilot_fraction": 1.5}, "pilot_fraction"), ({"enabled": 1}, "enabled"),
    ({"ttft_p99_ms": float("nan")}, "ttft_p99_ms"), ({"min_requests": True}, "min_requests"),
])
def test_bad_budgets_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(GuardError) as err:
        SloBudget(**kwargs)
    assert err.value.field == field


def test_min_requests_at_the_bound_is_reached_when_most_requests_measure_no_ttft():
    """The window keeps up to ``DEFAULT_MAX_OBSERVATIONS`` samples *of each latency*: requests
    that measured no TTFT (not streamed) take no room, so ``min_requests`` at the registry's
    bound can be reached at any traffic."""
    guard = SloGuard(SloBudget(ttft_p99_ms=100, window_seconds=60, min_requests=MAX_MIN_REQUESTS))
    for second in range(150):  # 200 requests/s, one in two unary; every streamed one 10x over budget
        for i in range(200):
            guard.observe(Observation(second + i / 200, 1.0 if i % 2 else None, None))
        guard.evaluate(second + 1.0)
    assert guard.tripped, guard.state(150.0).window


def test_a_budget_above_the_bound_is_kept_whole_and_can_trip():
    """A budget stored before the registry's bound (``min_requests`` above it) still trips: the
    guard keeps at least ``min_requests`` samples."""
    guard = SloGuard(SloBudget(ttft_p99_ms=100, window_seconds=60, min_requests=5000))
    for second in range(150):  # 200 requests/s, every one 10x over budget
        for i in range(200):
            guard.observe(Observation(second + i / 200, 1.0, None))
        guard.evaluate(second + 1.0)
    assert guard.tripped and guard.state(150.0).since == 85.0  # 5000 samples at t=25, then a whole window


def test_the_window_holds_the_newest_samples_within_window_seconds():
    guard = SloGuard(BUDGET, max_observations=100)
    for i in range(1000):  # 100 requests/s for 10 s; the TTFT grows with time
        guard.observe(Observation(i / 100, i / 1000, 0.01))
    window = guard.summary(9.99)
    assert (window.ttft_samples, window.itl_samples) == (100, 100)
    assert window.ttft_p99 == 0.998  # of the newest 100 (the last second), not of the whole 10 s


def test_untripped_the_trip_is_judged_on_the_host_arm_alone():
    """Pilot mode: the rollback arm runs without the host tier, so its latency says nothing about
    the tier. A slow rollback arm never trips the guard; a slow host arm does."""
    guard = SloGuard(BUDGET)
    for t in range(60):
        guard.observe(Observation(t, 0.1, None, arm=ARM_HOST))
        guard.observe(Observation(t, 5.0, None, arm=ARM_ROLLBACK))
        assert guard.evaluate(t) is None
    assert not guard.tripped and guard.state(59).window.ttft_p99 == 0.1
    for t in range(60, 90):
        guard.observe(Observation(t, 0.8, None, arm=ARM_HOST))
        guard.observe(Observation(t, 0.1, None, arm=ARM_ROLLBACK))
        guard.evaluate(t)
    assert guard.tripped and "ttft p99 800 ms" in guard.state(90).last_reason


def test_tripped_the_restore_is_judged_on_the_rollback_requests():
    """While tripped every request is planned in the rollback arm: they decide the restore."""
    guard, tripped_at = _tripped_guard()
    t = tripped_at + 1
    while t <= tripped_at + 31:
        guard.observe(Observation(t, 0.1, None, arm=ARM_ROLLBACK))
        guard.evaluate(t)
        t += 1
    assert not guard.tripped and guard.restores == 1
