"""``<policy>+hints``: any simulator policy with the trace's client cache hints on top.

The wrapped policy plans first (``lru``, ``trtllm-default``, ``class``, ``adaptive``, ...);
then the request's hints (the trace line's ``cache_breakpoints`` / ``prompt_cache_retention``,
``retention/trace.py``) go on top through the very code the gateway runs
(:func:`retention.policy.hint_quota.plan_with_hints`): within the request's class's hint rules and
its hint budget (the class's ``quota_fraction`` of the tenant's quota share of the GPU
blocks, counted by a :class:`~retention.policy.hint_quota.HintLedger`). Lines without hints are
planned by the wrapped policy alone, so ``X`` and ``X+hints`` differ only where hints are.

Rules: with ``--classes`` each class's ``hints`` entry (absent = hints off, as in the
registry); without, :data:`SIM_HINTS` for every request (hints honoured: at most 1 h, at
priority 60, hinted blocks at most half of the tenant's share, which is the whole pool).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import HintLedger, plan_with_hints
from retention.trace import TraceRequest
from retention.types import RetentionPlan

SIM_HINTS = HintPolicy(enabled=True)
SUFFIX = "+hints"


@dataclass(slots=True)
class HintedPolicy:
    inner: object  # a SimPolicy (retention.simulation.sim_policies)
    rules: Callable[[TraceRequest], HintPolicy] | None = None  # None: SIM_HINTS for every request
    quotas: Mapping[str, float] = field(default_factory=dict)  # tenant -> share of GPU blocks (default 1.0)
    ledger: HintLedger = field(default_factory=HintLedger)
    hinted_requests: int = 0  # requests whose plan a hint changed
    clipped_requests: int = 0  # requests whose hints the budget cut short
    label: str | None = None  # the name in reports (default: the wrapped policy's + "+hints")

    @property
    def name(self) -> str:
        return self.label or self.inner.name + SUFFIX  # type: ignore[attr-defined]

    @property
    def uses_host(self) -> bool:
        return self.inner.uses_host  # type: ignore[attr-defined]

    @property
    def offload_min_priority(self) -> int:
        return self.inner.offload_min_priority  # type: ignore[attr-defined]

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        plan = self.inner.plan(request, hashes, now=now, pool=pool)  # type: ignore[attr-defined]
        if request.hints is None:
            return plan
        rules = SIM_HINTS if self.rules is None else self.rules(request)
        cfg = pool.config
        budget = rules.budget_blocks(self.quotas.get(request.tenant or "", 1.0), cfg.primary_blocks)
        out = plan_with_hints(plan, request.hints, rules, total=request.input_length,
                              tokens_per_block=cfg.tokens_per_block, hashes=hashes, ledger=self.ledger,
                              tenant=request.tenant or "", budget_blocks=budget, now=now)
        self.hinted_requests += out.plan is not plan
        self.clipped_requests += out.clipped
        return out.plan

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - SimPolicy protocol
        self.inner.observe(request, hashes, allocation, now=now, pool=pool)  # type: ignore[attr-defined]
