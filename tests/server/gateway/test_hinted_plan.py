"""The gateway's hinted plan: the class's (or the selector's) plan first, the client's hints on
top within the class, the hint budget a share of the tenant's KV quota."""

from __future__ import annotations

import dataclasses

from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import HintLedger
from retention.policy.hints import TTL_1H_MS, Breakpoint, CacheHints
from retention.policy.selection import AdaptiveSelector
from server.gateway.api.completions import build_plan, hinted_plan, request_hashes
from tests.server.gateway.test_adaptive_plan import POOL, TPB, job, unique_prompt

ALLOW = HintPolicy(enabled=True, max_ttl_ms=TTL_1H_MS, max_priority=70, quota_fraction=0.5)


def hinted_job(ids, *, policy=ALLOW, hints=CacheHints(retention="24h"), mode="static", over_quota=False):  # type: ignore[no-untyped-def]
    j = job(ids, mode=mode, over_quota=over_quota)
    j.tenant = dataclasses.replace(j.tenant, hints=policy)
    j.hints = hints
    return j


def test_static_class_hints_on_top_and_the_same_plan_without_them() -> None:
    ids = unique_prompt(4)
    ledger = HintLedger()
    j = hinted_job(ids)
    base = build_plan(j)
    out = hinted_plan(j, base, None, ledger, now=0.0)
    assert [(r.priority, r.duration_ms) for r in out.plan.ranges] == [(70, TTL_1H_MS)]  # context 60 raised to the cap
    off = hinted_job(ids, policy=HintPolicy(enabled=False))
    same = build_plan(off)
    assert hinted_plan(off, same, None, ledger, now=0.0).plan is same


def test_adaptive_class_the_selectors_plan_then_hints_within_the_cap() -> None:
    selector = AdaptiveSelector(POOL.primary_blocks, 0, POOL.secondary_offload_min_priority, names=("bands",))
    ids = unique_prompt(4)
    j = hinted_job(ids, mode="adaptive", hints=CacheHints(breakpoints=(Breakpoint(2 * TPB, TTL_1H_MS),)))
    hashes = request_hashes(j)
    chosen = build_plan(j, selector, 0.0, hashes)
    out = hinted_plan(j, chosen, hashes, HintLedger(), now=0.0)
    for token in range(len(ids)):
        before, _ = chosen.retention_at(token)
        after, _ = out.plan.retention_at(token)
        assert before <= after <= max(before, 70)
        if token >= 2 * TPB:
            assert out.plan.retention_at(token) == chosen.retention_at(token)  # past the breakpoint: the selector's
    assert out.plan.retention_at(0)[0] == 70


def test_over_quota_demotion_wins_over_hints() -> None:
    j = hinted_job(unique_prompt(4), over_quota=True)
    demoted = build_plan(j)
    assert hinted_plan(j, demoted, None, HintLedger(), now=0.0).plan is demoted


def test_the_hint_budget_is_the_class_share_of_the_tenant_quota() -> None:
    # quota 0.5 of 256 GPU blocks = 128; hint share 0.05 -> 6 blocks of this tenant may be hinted.
    small = HintPolicy(enabled=True, max_ttl_ms=TTL_1H_MS, max_priority=70, quota_fraction=0.05)
    ledger = HintLedger()
    first = hinted_plan(hinted_job(unique_prompt(4), policy=small), build_plan(hinted_job(unique_prompt(4))), None,
                        ledger, now=0.0)
    assert len(first.hashes) == 4 and not first.clipped
    second = hinted_plan(hinted_job(unique_prompt(4), policy=small), build_plan(hinted_job(unique_prompt(4))), None,
                         ledger, now=1.0)
    assert len(second.hashes) == 2 and second.clipped
    assert ledger.live_blocks("1", now=2.0) == 6
