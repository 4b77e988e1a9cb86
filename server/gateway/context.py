"""What the gateway knows about an authenticated request's tenant and pool.

A frozen snapshot taken from the registry at authentication time (and cached with the
key for the auth TTL), so a request never touches the database after auth.
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.policy.hint_plan import HINTS_OFF, HintPolicy
from retention.policy.planner import RetentionClassSpec
from server.gateway.admission import Limits
from tenants.snapshots import PoolSnapshot


@dataclass(frozen=True, slots=True)
class TenantContext:
    tenant_id: int
    slug: str
    status: str
    isolation: str  # shared | salted | dedicated
    cache_salt: str
    limits: Limits
    kv_quota_fraction: float
    pool: PoolSnapshot
    retention: RetentionClassSpec
    key_id: int
    retention_mode: str = "static"  # static | adaptive (retention/policy/adaptive.py)
    retention_class: str = ""  # the class's name (trace capture lines carry it)
    hints: HintPolicy = HINTS_OFF  # the class's rules for client cache hints (retention/policy/hint_plan.py)

    @property
    def engine_tenant_id(self) -> str:
        """The id the engine attributes blocks to (stable, not secret)."""
        return str(self.tenant_id)

    @property
    def engine_salt(self) -> str | None:
        """Cache salt sent to the engine: none for ``shared`` (prefixes shared across tenants)."""
        return None if self.isolation == "shared" else self.cache_salt
