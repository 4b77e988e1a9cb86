"""Frozen, session-free snapshots of registry rows for the gateway's hot path.

The gateway caches these; they hold no ORM state and cannot lazy-load, so they are safe
to share across threads and event loops.
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.policy.hint_plan import HINTS_OFF, HintPolicy  # the class's rules for client cache hints
from retention.policy.planner import SegmentRetention  # one segment's retention, shared with the planner
from retention.rollout.guard import SloBudget
from tenants.models import Pool, PoolReplica, PoolSloBudget, RetentionClass, Tenant, primary_endpoint


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One engine endpoint of a pool; ``state`` is ``active | draining | disabled``."""

    id: int
    name: str
    endpoint: str
    state: str
    weight: int

    @classmethod
    def of(cls, replica: PoolReplica) -> ReplicaSnapshot:
        return cls(
            id=replica.id, name=replica.name, endpoint=replica.endpoint, state=replica.state, weight=replica.weight
        )


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool and its replicas (ordered by id; a registry pool always has at least one)."""

    id: int
    name: str
    model_name: str
    triton_model: str
    engine_spec: str
    tokens_per_block: int
    primary_blocks: int
    secondary_blocks: int
    secondary_offload_min_priority: int
    replicas: tuple[ReplicaSnapshot, ...]
    slo: SloBudget | None = None  # the SLO guard's budget (tenants.slo); None = no guard

    @property
    def triton_url(self) -> str:
        """Legacy single endpoint: the first active replica's, else the first replica's.

        Kept so code written for one endpoint per pool keeps working; routing over all
        replicas reads ``replicas``.
        """
        return primary_endpoint(self.replicas)

    @property
    def active_replicas(self) -> tuple[ReplicaSnapshot, ...]:
        return tuple(r for r in self.replicas if r.state == "active")

    @classmethod
    def of(cls, pool: Pool) -> PoolSnapshot:
        return cls(
            id=pool.id,
            name=pool.name,
            model_name=pool.model_name,
            triton_model=pool.triton_model,
            engine_spec=pool.engine_spec,
            tokens_per_block=pool.tokens_per_block,
            primary_blocks=pool.primary_blocks,
            secondary_blocks=pool.secondary_blocks,
            secondary_offload_min_priority=pool.secondary_offload_min_priority,
            replicas=tuple(ReplicaSnapshot.of(r) for r in sorted(pool.replicas, key=lambda r: r.id)),
            slo=_budget(pool.slo),
        )


def _budget(row: PoolSloBudget | None) -> SloBudget | None:
    if row is None:
        return None
    return SloBudget(
        ttft_p99_ms=row.ttft_p99_ms, itl_p99_ms=row.itl_p99_ms, window_seconds=row.window_seconds,
        min_requests=row.min_requests, cooldown_seconds=row.cooldown_seconds, hysteresis=row.hysteresis,
        enabled=row.enabled, pilot_fraction=row.pilot_fraction,
    )


@dataclass(frozen=True, slots=True)
class RetentionClassSnapshot:
    id: int
    name: str
    system: SegmentRetention
    context: SegmentRetention
    turn: SegmentRetention
    decode: SegmentRetention
    mode: str = "static"
    hints: HintPolicy = HINTS_OFF
    conversation_hold: bool = False  # tool loops and stored conversations held (within the hint caps)
    # A tool-offering stored run that ends in a message demotes its conversation's own blocks to
    # priority 0 (server/gateway/api/conversation_demote.py); independent of the hold and its duel.
    conversation_end_demote: bool = False

    @classmethod
    def of(cls, row: RetentionClass) -> RetentionClassSnapshot:
        return cls(
            id=row.id,
            name=row.name,
            system=SegmentRetention(row.system_priority, row.system_duration_ms),
            context=SegmentRetention(row.context_priority, row.context_duration_ms),
            turn=SegmentRetention(row.turn_priority, row.turn_duration_ms),
            decode=SegmentRetention(row.decode_priority, row.decode_duration_ms),
            mode=row.mode,
            hints=HintPolicy(enabled=row.hints_enabled, max_ttl_ms=row.hint_max_ttl_ms,
                             max_priority=row.hint_max_priority, quota_fraction=row.hint_quota_fraction),
            conversation_hold=row.conversation_hold_enabled,
            conversation_end_demote=row.conversation_end_demote_enabled,
        )


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rpm: int
    tpm: int
    max_concurrent_requests: int
    max_prompt_tokens: int
    max_output_tokens: int

    @classmethod
    def of(cls, tenant: Tenant) -> TenantLimits:
        return cls(
            rpm=tenant.rpm_limit,
            tpm=tenant.tpm_limit,
            max_concurrent_requests=tenant.max_concurrent_requests,
            max_prompt_tokens=tenant.max_prompt_tokens,
            max_output_tokens=tenant.max_output_tokens,
        )


@dataclass(frozen=True, slots=True)
class TenantSummary:
    """What the gateway needs about every active tenant of a pool (quotas, metric labels)."""

    id: int
    slug: str
    isolation: str
    kv_quota_fraction: float
    cache_salt: str

    def __repr__(self) -> str:
        return f"TenantSummary(id={self.id}, slug={self.slug!r}, isolation={self.isolation!r})"


@dataclass(frozen=True, slots=True)
class AuthenticatedTenant:
    """Result of a successful key check. ``usable`` is the one flag the gateway must test.

    A key that matched but is revoked or expired, or whose tenant is suspended, still
    yields a snapshot (so the gateway can say *why*), with ``usable`` False.
    """

    tenant_id: int
    slug: str
    status: str
    isolation: str
    cache_salt: str
    limits: TenantLimits
    kv_quota_fraction: float
    pool: PoolSnapshot
    retention: RetentionClassSnapshot
    key_id: int
    key_revoked: bool
    key_expired: bool

    @property
    def usable(self) -> bool:
        return self.status == "active" and not self.key_revoked and not self.key_expired

    def __repr__(self) -> str:  # keep the salt out of logs and tracebacks
        return (
            f"AuthenticatedTenant(tenant_id={self.tenant_id}, slug={self.slug!r}, status={self.status!r}, "
            f"key_id={self.key_id}, usable={self.usable})"
        )
