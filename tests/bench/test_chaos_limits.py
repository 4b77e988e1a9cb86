"""The chaos run's lowered-limit measurement (``bench/reliability/chaos_limits.py``) on made-up engine calls.

The shape of the failing run: a tenant had many calls in flight under its old limit when the
limit was lowered to 4; they outlive the bound on a loaded machine; a call reaching the
engine after the bound is counted together with them. The arrival-instant count reports them
all; the count once they have ended sees only the new admissions.
"""

from __future__ import annotations

from types import SimpleNamespace

from bench.reliability.chaos_limits import breakdown, max_after_drained, max_at_arrivals

CHANGE, BOUND = 100.0, 5.0


def call(arrived: float, ended: float | None) -> SimpleNamespace:
    return SimpleNamespace(arrived=arrived, ended=ended)


def test_calls_admitted_under_the_old_limit_are_counted_at_arrivals_after_the_bound_not_once_drained() -> None:
    old = [call(CHANGE - 1 + i * 0.01, CHANGE + 9.0) for i in range(15)]  # still running 9 s after the change
    late = [call(CHANGE + 6.0, CHANGE + 6.5)]  # reaches the engine after the bound, among the old ones
    new = [call(CHANGE + 10.0 + i, CHANGE + 10.5 + i) for i in range(3)] + \
        [call(CHANGE + 10.1, CHANGE + 11.0), call(CHANGE + 10.2, CHANGE + 11.0), call(CHANGE + 10.3, CHANGE + 11.0)]
    calls = sorted(old + late + new, key=lambda c: c.arrived)
    assert max_at_arrivals(calls, after=CHANGE + BOUND) == 16
    assert breakdown(calls, changed=CHANGE, bound_s=BOUND) == {
        "instant_s_after_change": 6.0, "arrived_before_change": 15, "arrived_within_bound": 0,
        "arrived_after_bound": 1, "never_ended": 0, "oldest_age_s": 7.0}
    assert max_after_drained(calls, bound=CHANGE + BOUND) == 4


def test_a_new_admission_above_the_limit_after_the_drain_is_counted() -> None:
    calls = [call(CHANGE + 10.0 + i * 0.1, CHANGE + 12.0) for i in range(6)]
    assert max_after_drained(calls, bound=CHANGE + BOUND) == 6


def test_a_call_that_never_ended_before_the_bound_leaves_nothing_to_count() -> None:
    calls = [call(CHANGE, None), call(CHANGE + 10.0, CHANGE + 11.0)]
    assert max_after_drained(calls, bound=CHANGE + BOUND) == 0
