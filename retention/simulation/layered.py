"""A simulator policy laid over another: the wrapped policy plans, the layer adds to its plan.

``<policy>+hints`` (:mod:`retention.simulation.hinted`) and ``<policy>+conv``
(:mod:`retention.simulation.conversational`) are layers: both plan through the wrapped
policy, honour the request's class's hint rules (:data:`SIM_HINTS` for every request when
the simulation has no classes) and spend one budget, the class's ``quota_fraction`` of the
tenant's quota share of the GPU blocks. Invariant: a layer never changes where the wrapped
policy keeps blocks (host tier, offload threshold) and observes exactly what it observes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from retention.policy.hint_plan import HintPolicy
from retention.trace import TraceRequest

SIM_HINTS = HintPolicy(enabled=True)


@dataclass(slots=True)
class LayeredPolicy:
    inner: object  # a SimPolicy (retention.simulation.sim_policies)
    rules: Callable[[TraceRequest], HintPolicy] | None = None  # None: SIM_HINTS for every request
    quotas: Mapping[str, float] = field(default_factory=dict)  # tenant -> share of GPU blocks (default 1.0)

    @property
    def uses_host(self) -> bool:
        return self.inner.uses_host  # type: ignore[attr-defined]

    @property
    def offload_min_priority(self) -> int:
        return self.inner.offload_min_priority  # type: ignore[attr-defined]

    def rules_for(self, request: TraceRequest) -> HintPolicy:
        return SIM_HINTS if self.rules is None else self.rules(request)

    def budget_blocks(self, rules: HintPolicy, request: TraceRequest, primary_blocks: int) -> int:
        """The request's tenant's hint budget, in GPU blocks."""
        return rules.budget_blocks(self.quotas.get(request.tenant or "", 1.0), primary_blocks)

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - SimPolicy protocol
        self.inner.observe(request, hashes, allocation, now=now, pool=pool)  # type: ignore[attr-defined]
