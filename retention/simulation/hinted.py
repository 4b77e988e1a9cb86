"""``<policy>+hints``: any simulator policy with the trace's client cache hints on top.

The wrapped policy plans first (``lru``, ``trtllm-default``, ``class``, ``adaptive``, ...);
then the request's hints (the trace line's ``cache_breakpoints`` / ``prompt_cache_retention``,
``retention/trace.py``) go on top through the very code the gateway runs
(:func:`retention.policy.hint_quota.plan_with_hints`): within the request's class's hint rules and
its hint budget (the class's ``quota_fraction`` of the tenant's quota share of the GPU
blocks, counted by a :class:`~retention.policy.hint_quota.HintLedger`). A line without hints is
planned by the wrapped policy, with the blocks of its tenant an earlier hint still holds kept
at the hint's priority for the rest of the hold (:func:`~retention.policy.hint_quota.keep_pins`,
as the gateway does), so ``X`` and ``X+hints`` differ only where hints are or were.

Rules: with ``--classes`` each class's ``hints`` entry (absent = hints off, as in the
registry); without, :data:`SIM_HINTS` for every request (hints honoured: at most 1 h, at
priority 60, hinted blocks at most half of the tenant's share, which is the whole pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retention.policy.hint_quota import HintedPlan, HintLedger, keep_pins, plan_with_hints
from retention.simulation.layered import SIM_HINTS, LayeredPolicy
from retention.types import RetentionPlan

__all__ = ["SIM_HINTS", "SUFFIX", "HintedPolicy"]

SUFFIX = "+hints"


@dataclass(slots=True)
class HintedPolicy(LayeredPolicy):
    ledger: HintLedger = field(default_factory=HintLedger)
    hinted_requests: int = 0  # requests whose plan a hint changed
    clipped_requests: int = 0  # requests whose hints the budget cut short
    label: str | None = None  # the name in reports (default: the wrapped policy's + "+hints")

    @property
    def name(self) -> str:
        return self.label or self.inner.name + SUFFIX  # type: ignore[attr-defined]

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        plan = self.inner.plan(request, hashes, now=now, pool=pool)  # type: ignore[attr-defined]
        rules = self.rules_for(request)
        tenant = request.tenant or ""
        # As the gateway: an earlier hint's blocks this request reuses keep their hold (keep_pins),
        # read before the request's own hints are recorded.
        pins = self.ledger.pins(tenant, hashes, now) if rules.enabled and self.ledger.has_pins(tenant, now) else ()
        if request.hints is None and not pins:
            return plan
        cfg = pool.config
        out = HintedPlan(plan)
        if request.hints is not None:
            budget = self.budget_blocks(rules, request, cfg.primary_blocks)
            out = plan_with_hints(plan, request.hints, rules, total=request.input_length,
                                  tokens_per_block=cfg.tokens_per_block, hashes=hashes, ledger=self.ledger,
                                  tenant=tenant, budget_blocks=budget, now=now)
            self.hinted_requests += out.plan is not plan
            self.clipped_requests += out.clipped
        if pins:
            out = keep_pins(out, pins, rules, total=request.input_length, tokens_per_block=cfg.tokens_per_block,
                            hashes=hashes, ledger=self.ledger, tenant=tenant, now=now)
        return out.plan
