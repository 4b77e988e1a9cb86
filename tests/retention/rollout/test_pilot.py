"""Pilot split: stable, monotone, close to the fraction; both arms summarised side by side."""

from __future__ import annotations

import pytest

from retention.rollout.guard import GuardError, Observation
from retention.rollout.pilot import PilotReport, pilot_arm


def test_split_is_stable_and_near_the_fraction():
    tenants = [str(i) for i in range(2000)]
    first = [pilot_arm(t, 0.3) for t in tenants]
    assert first == [pilot_arm(t, 0.3) for t in tenants]  # same answer every time (no state)
    share = first.count("host") / len(tenants)
    assert 0.25 < share < 0.35


def test_split_is_monotone_in_the_fraction():
    tenants = [str(i) for i in range(500)]
    at = {f: {t for t in tenants if pilot_arm(t, f) == "host"} for f in (0.0, 0.2, 0.5, 0.8, 1.0)}
    assert at[0.0] == set() and at[1.0] == set(tenants)
    assert at[0.2] <= at[0.5] <= at[0.8]


def test_bad_fraction_is_refused():
    with pytest.raises(GuardError):
        pilot_arm("1", 1.2)


def test_report_has_both_arms_side_by_side():
    report = PilotReport(window_seconds=10)
    for i in range(10):
        report.observe(Observation(float(i), 0.1 + 0.01 * i, 0.02, arm="host", cache="host_hit" if i % 2 else "gpu_hit"))
        report.observe(Observation(float(i), 0.5, 0.03, arm="rollback", cache="miss"))
    report.observe(Observation(-20.0, 9.0, None, arm="host"))  # outside the window: ignored
    arms = report.summary(9.0)
    host, rollback = arms["host"], arms["rollback"]
    assert (host.requests, host.gpu_hits, host.host_hits, host.misses) == (10, 5, 5, 0)
    assert host.ttft_p99 == pytest.approx(0.19) and host.ttft_p50 == pytest.approx(0.14)
    assert (rollback.requests, rollback.misses, rollback.hit_ratio) == (10, 10, 0.0)
    assert host.hit_ratio == 1.0 and rollback.itl_p99 == 0.03
