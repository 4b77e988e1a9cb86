"""Per-tenant KV quotas with hysteresis: who is over quota right now.

A tenant's quota is a fraction of the pool's primary (GPU) blocks. It becomes *over
quota* when the primary blocks it holds (in use or cached, ``BlockPool.tenant_blocks``)
exceed the high watermark ``fraction × capacity``, and stays over until it falls to the
low watermark ``fraction × capacity × (1 − hysteresis)``; in between nothing changes, so
the planner's demotion (``QuotaState.over_quota`` → priority 0) does not flap::

    blocks ▲        demote here                        restore here
           │  high ─────●───────────────────────────────────────────
           │  low  ─────────────────────────────────────────●───────
           └──────────────────────────────────────────────────────► time

Restart: the state is a pure function of the counts *plus* which tenants were between
the watermarks and demoted. :meth:`QuotaTracker.rebuild` restores it from counts alone:
a tenant above the high watermark is demoted at once, one between the watermarks starts
undemoted (the conservative choice: it is demoted again as soon as it crosses ``high``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from retention.policy.planner import QuotaState


class QuotaError(ValueError):
    """Invalid quota configuration (fraction or hysteresis out of range)."""


@dataclass(frozen=True, slots=True)
class QuotaChange:
    tenant: str
    over_quota: bool
    primary_blocks: int
    limit_blocks: float


@dataclass(slots=True)
class QuotaTracker:
    """Hysteresis state for one pool. ``quotas``: tenant -> fraction of primary blocks."""

    capacity_blocks: int
    quotas: dict[str, float]
    hysteresis: float = 0.1
    demoted: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise QuotaError("capacity_blocks must be >= 1")
        if not 0.0 <= self.hysteresis < 1.0:
            raise QuotaError(f"hysteresis must be within [0, 1), got {self.hysteresis}")
        for tenant, fraction in self.quotas.items():
            if not 0.0 < fraction <= 1.0:
                raise QuotaError(f"quota of {tenant!r} must be a fraction within (0, 1], got {fraction}")

    def high(self, tenant: str) -> float:
        return self.quotas[tenant] * self.capacity_blocks

    def low(self, tenant: str) -> float:
        return self.high(tenant) * (1.0 - self.hysteresis)

    def update(self, tenant_blocks: Mapping[str, tuple[int, int]]) -> list[QuotaChange]:
        """Fold in fresh counts (tenant -> (primary, secondary)); returns the state changes."""
        changes: list[QuotaChange] = []
        for tenant in self.quotas:
            primary = tenant_blocks.get(tenant, (0, 0))[0]
            if tenant in self.demoted:
                if primary <= self.low(tenant):
                    self.demoted.discard(tenant)
                    changes.append(QuotaChange(tenant, False, primary, self.low(tenant)))
            elif primary > self.high(tenant):
                self.demoted.add(tenant)
                changes.append(QuotaChange(tenant, True, primary, self.high(tenant)))
        return changes

    def state(self, tenant: str | None) -> QuotaState:
        """The planner's view; tenants without a quota are never over it."""
        return QuotaState(over_quota=tenant is not None and tenant in self.demoted)

    def usage(self, tenant_blocks: Mapping[str, tuple[int, int]]) -> dict[str, float]:
        """Share of its quota each tenant uses (1.0 = at the high watermark), for metrics."""
        return {t: tenant_blocks.get(t, (0, 0))[0] / self.high(t) for t in self.quotas}

    @classmethod
    def rebuild(
        cls,
        capacity_blocks: int,
        quotas: Mapping[str, float],
        tenant_blocks: Mapping[str, tuple[int, int]],
        *,
        hysteresis: float = 0.1,
    ) -> QuotaTracker:
        """State after a restart, from the pool's per-tenant counts alone (see module docstring)."""
        tracker = cls(capacity_blocks, dict(quotas), hysteresis)
        tracker.update(tenant_blocks)
        return tracker
