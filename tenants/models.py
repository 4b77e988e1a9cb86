"""SQLAlchemy 2.x models of the tenant registry.

Tables: ``pools`` (engine deployments), ``pool_replicas`` (a pool's engine endpoints),
``pool_slo_budgets`` (a pool's latency budget for the gateway's SLO guard, at most one),
``retention_classes`` (TensorRT-LLM retention
priorities/durations per prompt segment), ``tenants``, ``api_keys`` (HMAC of the secret,
never the plaintext), ``audit_events``, ``usage`` (per tenant per minute) and
``usage_flushes`` (idempotency ledger for usage batches) and ``trace_captures`` (opt-in
live trace capture per pool, optionally one tenant; the gateway writes the files).

Invariants kept by the database itself (CHECK / UNIQUE / FK), so that no writer —
service, CLI or a hand-written SQL session — can store a state the services refuse:
priorities in [0, 100], durations >= 0 or NULL (= no expiry), KV quota in (0, 1],
a pool or class in use cannot be deleted (``ON DELETE RESTRICT``). Enumerations are
strings with CHECKs rather than native enum types, so migrations stay portable.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy import false, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

TENANT_STATUSES = ("active", "suspended")
REPLICA_STATES = ("active", "draining", "disabled")
CAPTURE_STATES = ("active", "stopped")
ISOLATIONS = ("shared", "salted", "dedicated")
ADMIN_ROLES = ("platform-admin", "operator", "tenant-admin", "viewer")
# Limits a tenant-admin may change itself, each within the cap the platform admin set.
CAPPED_LIMITS = ("rpm_limit", "tpm_limit", "max_concurrent_requests", "max_prompt_tokens", "max_output_tokens",
                 "kv_quota_fraction")
SEGMENTS = ("system", "context", "turn")

# Deterministic constraint names: Alembic can drop/alter them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# SQLite hands a new row max(id) + 1 unless the table is AUTOINCREMENT: the id of a deleted
# newest row (a tenant, a key) would name the next one, in late usage batches and in audit
# histories. Every table whose id is shown or kept elsewhere declares it (migration 0011);
# PostgreSQL sequences never reuse an id. The dict goes last in ``__table_args__``.
NEVER_REUSED_IDS: dict[str, Any] = {"sqlite_autoincrement": True}


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on the way in and out (SQLite drops the offset on storage)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UtcDateTime()}


def _priority_check(column: str) -> CheckConstraint:
    return CheckConstraint(f"{column} >= 0 AND {column} <= 100", name=f"{column}_range")


def _duration_check(column: str) -> CheckConstraint:
    return CheckConstraint(f"{column} IS NULL OR {column} >= 0", name=f"{column}_nonneg")


class Timestamped:
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Optimistic concurrency: every update is ``... WHERE id = ? AND version = ?``.
    version: Mapped[int] = mapped_column(Integer, default=1)


class Pool(Timestamped, Base):
    """An engine deployment: one model served by one or more replicas (``pool_replicas``).

    Invariant (kept by the services, ``tenants.replicas``): a pool always has at least
    one replica row; ``replicas`` is ordered by id, so the first one is the oldest.
    """

    __tablename__ = "pools"
    __table_args__ = (
        _priority_check("secondary_offload_min_priority"),
        CheckConstraint("tokens_per_block >= 1", name="tokens_per_block_pos"),
        CheckConstraint("primary_blocks >= 1", name="primary_blocks_pos"),
        CheckConstraint("secondary_blocks >= 0", name="secondary_blocks_nonneg"),
        NEVER_REUSED_IDS,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    model_name: Mapped[str] = mapped_column(String(128))
    triton_model: Mapped[str] = mapped_column(String(128), default="kvgate_llm")
    engine_spec: Mapped[str] = mapped_column(String(128), default="")
    tokens_per_block: Mapped[int] = mapped_column(Integer)
    primary_blocks: Mapped[int] = mapped_column(Integer)
    secondary_blocks: Mapped[int] = mapped_column(Integer, default=0)
    # TensorRT-LLM KvCacheConfig::secondaryOffloadMinPriority, inclusive
    # (cpp/include/tensorrt_llm/executor/executor.h); always stored explicitly.
    secondary_offload_min_priority: Mapped[int] = mapped_column(Integer)
    # selectin: every Pool load brings its replicas in one extra query (snapshots need them).
    replicas: Mapped[list[PoolReplica]] = relationship(
        back_populates="pool",
        order_by="PoolReplica.id",
        lazy="selectin",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )

    # At most one SLO budget (the gateway's guard, retention/rollout/guard.py); selectin
    # like the replicas, so snapshots never lazy-load.
    slo: Mapped[PoolSloBudget | None] = relationship(
        back_populates="pool", lazy="selectin", cascade="all, delete-orphan", passive_deletes=True, uselist=False
    )

    @property
    def triton_url(self) -> str:
        """Legacy single endpoint: the first active replica's, else the first replica's."""
        return primary_endpoint(self.replicas)


class PoolSloBudget(Timestamped, Base):
    """A pool's latency budget and guard settings (``retention.rollout.guard.SloBudget``).

    Budgets in milliseconds (NULL = that latency is not guarded), times in whole seconds.
    """

    __tablename__ = "pool_slo_budgets"
    __table_args__ = (
        CheckConstraint("ttft_p99_ms IS NULL OR ttft_p99_ms >= 1", name="ttft_p99_ms_pos"),
        CheckConstraint("itl_p99_ms IS NULL OR itl_p99_ms >= 1", name="itl_p99_ms_pos"),
        CheckConstraint("window_seconds >= 1", name="window_seconds_pos"),
        CheckConstraint("min_requests >= 1", name="min_requests_pos"),
        CheckConstraint("cooldown_seconds >= 0", name="cooldown_seconds_nonneg"),
        CheckConstraint("hysteresis >= 0 AND hysteresis < 1", name="hysteresis_range"),
        CheckConstraint("pilot_fraction >= 0 AND pilot_fraction <= 1", name="pilot_fraction_range"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="CASCADE"), unique=True)
    ttft_p99_ms: Mapped[int | None] = mapped_column(Integer)
    itl_p99_ms: Mapped[int | None] = mapped_column(Integer)
    window_seconds: Mapped[int] = mapped_column(Integer)
    min_requests: Mapped[int] = mapped_column(Integer)
    cooldown_seconds: Mapped[int] = mapped_column(Integer)
    hysteresis: Mapped[float] = mapped_column(Float)
    enabled: Mapped[bool] = mapped_column(Boolean)
    pilot_fraction: Mapped[float] = mapped_column(Float)
    pool: Mapped[Pool] = relationship(back_populates="slo")


class PoolReplica(Timestamped, Base):
    """One engine endpoint (Triton or reference server, gRPC ``host:port``) of a pool.

    ``state``: ``active`` gets new requests, ``draining`` finishes what it has and gets
    none, ``disabled`` is out of rotation. ``weight`` scales the replica's share.
    """

    __tablename__ = "pool_replicas"
    __table_args__ = (
        UniqueConstraint("pool_id", "name", name="uq_pool_replicas_pool_id_name"),
        CheckConstraint("state IN ('active', 'draining', 'disabled')", name="state_enum"),
        CheckConstraint("weight >= 1", name="weight_pos"),
        NEVER_REUSED_IDS,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16), default="active")
    weight: Mapped[int] = mapped_column(Integer, default=1)
    pool: Mapped[Pool] = relationship(back_populates="replicas")


def primary_endpoint(replicas: Any) -> str:
    """The first active replica's endpoint (by id), else the first replica's, else ``""``."""
    for replica in replicas:
        if replica.state == "active":
            return str(replica.endpoint)
    return str(replicas[0].endpoint) if replicas else ""


class RetentionClass(Timestamped, Base):
    """Retention priority/duration per prompt segment and for decoded tokens.

    Mirrors ``KvCacheRetentionConfig`` (TensorRT-LLM ``executor.h``): NULL duration =
    the priority never expires.
    """

    __tablename__ = "retention_classes"
    __table_args__ = (
        *(
            check
            for seg in (*SEGMENTS, "decode")
            for check in (_priority_check(f"{seg}_priority"), _duration_check(f"{seg}_duration_ms"))
        ),
        CheckConstraint("mode IN ('static', 'adaptive')", name="mode_enum"),
        CheckConstraint("hint_max_ttl_ms > 0", name="hint_max_ttl_ms_pos"),
        _priority_check("hint_max_priority"),
        CheckConstraint("hint_quota_fraction > 0 AND hint_quota_fraction <= 1", name="hint_quota_fraction_range"),
        NEVER_REUSED_IDS,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    system_priority: Mapped[int] = mapped_column(Integer)
    system_duration_ms: Mapped[int | None] = mapped_column(BigInteger)
    context_priority: Mapped[int] = mapped_column(Integer)
    context_duration_ms: Mapped[int | None] = mapped_column(BigInteger)
    turn_priority: Mapped[int] = mapped_column(Integer)
    turn_duration_ms: Mapped[int | None] = mapped_column(BigInteger)
    decode_priority: Mapped[int] = mapped_column(Integer)
    decode_duration_ms: Mapped[int | None] = mapped_column(BigInteger)
    # static: the segment priorities above; adaptive: per-block priorities from measured
    # reuse (retention/policy/adaptive.py), the decode priority still from this class.
    mode: Mapped[str] = mapped_column(String(16), default="static", server_default="static")
    # Client cache hints (retention/policy/hint_plan.py): honoured at all, the longest duration and
    # the one priority a hint may ask for, and the share of the tenant's KV quota hinted
    # blocks may hold. Off by default: a class opts in.
    hints_enabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    hint_max_ttl_ms: Mapped[int] = mapped_column(BigInteger, default=3_600_000, server_default="3600000")
    hint_max_priority: Mapped[int] = mapped_column(Integer, default=60, server_default="60")
    hint_quota_fraction: Mapped[float] = mapped_column(Float, default=0.5, server_default="0.5")
    # The conversation and tool-loop hold (retention/policy/conversation.py) and the demote on
    # delete: its own switch, bounded by the hint caps above. Off by default: a class opts in.
    conversation_hold_enabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The run's-end demote (server/gateway/api/conversation_demote.py): when a tool-offering
    # stored response ends in a message, the conversation's own blocks go to priority 0. Its own
    # switch, independent of the hold above and of its duel. Off by default: a class opts in.
    conversation_end_demote_enabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Tenant(Timestamped, Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'suspended')", name="status_enum"),
        CheckConstraint("isolation IN ('shared', 'salted', 'dedicated')", name="isolation_enum"),
        CheckConstraint("kv_quota_fraction > 0 AND kv_quota_fraction <= 1", name="kv_quota_range"),
        CheckConstraint(
            "rpm_limit >= 1 AND tpm_limit >= 1 AND max_concurrent_requests >= 1 "
            "AND max_prompt_tokens >= 1 AND max_output_tokens >= 1",
            name="limits_pos",
        ),
        NEVER_REUSED_IDS,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    slug: Mapped[str] = mapped_column(String(64), unique=True)
    display_name: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default="active")
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="RESTRICT"), index=True)
    retention_class_id: Mapped[int] = mapped_column(ForeignKey("retention_classes.id", ondelete="RESTRICT"), index=True)
    isolation: Mapped[str] = mapped_column(String(16), default="salted")
    # Server-generated (secrets.token_hex(16)); never accepted from a client, never listed.
    cache_salt: Mapped[str] = mapped_column(String(64))
    rpm_limit: Mapped[int] = mapped_column(Integer)
    tpm_limit: Mapped[int] = mapped_column(Integer)
    max_concurrent_requests: Mapped[int] = mapped_column(Integer)
    max_prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    kv_quota_fraction: Mapped[float] = mapped_column(Float)
    # {limit field: highest value a tenant-admin may set} (fields of CAPPED_LIMITS); a limit
    # without a cap cannot be changed by a tenant-admin. Set by platform admins only.
    limit_caps: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class ApiKey(Base):
    """A tenant's API key ``kvg_<prefix>_<secret>``; stores HMAC-SHA256(pepper, secret) only."""

    __tablename__ = "api_keys"
    __table_args__ = (NEVER_REUSED_IDS,)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column()
    expires_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()


class AdminCredential(Base):
    """An admin credential ``kva_<prefix>_<secret>`` with a role; stores HMAC-SHA256(pepper, secret) only.

    Invariants: ``role`` in ``ADMIN_ROLES``; a ``tenant-admin`` has at least one tenant in
    ``admin_credential_tenants`` (kept by the service); a rotation keeps the prefix, moves the
    old hash to ``previous_secret_hash`` and accepts it while ``now < previous_valid_until``.
    """

    __tablename__ = "admin_credentials"
    __table_args__ = (CheckConstraint(
        "role IN ('platform-admin', 'operator', 'tenant-admin', 'viewer')", name="role_enum"), NEVER_REUSED_IDS)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    # True when the credential is limited to the tenants in admin_credential_tenants.
    scoped: Mapped[bool] = mapped_column(Boolean, default=False)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    previous_secret_hash: Mapped[str | None] = mapped_column(String(64))
    previous_valid_until: Mapped[datetime | None] = mapped_column()
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column()
    expires_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()


class AdminCredentialTenant(Base):
    """One tenant in an admin credential's scope (deleting the tenant drops it from every scope)."""

    __tablename__ = "admin_credential_tenants"

    credential_id: Mapped[int] = mapped_column(ForeignKey("admin_credentials.id", ondelete="CASCADE"),
                                               primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True,
                                           index=True)


class AuditEvent(Base):
    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_entity", "entity_type", "entity_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    entity_type: Mapped[str] = mapped_column(String(32))
    entity_id: Mapped[str] = mapped_column(String(64))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Usage(Base):
    """Per-tenant counters per minute bucket (``minute`` = bucket start, UTC, seconds 0)."""

    __tablename__ = "usage"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Of the prompt tokens (migration 0012; rows written before it read 0): served from the KV
    # cache, and kept under a client cache hint by the TTL kept for (< 1 h, >= 1 h).
    cache_read_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cache_write_5m_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cache_write_1h_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class UsageFlush(Base):
    """One row per applied usage batch: the unique ``flush_id`` makes a retry a no-op."""

    __tablename__ = "usage_flushes"

    flush_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # The tenant when the batch covered exactly one, else NULL.
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="SET NULL"))
    row_count: Mapped[int] = mapped_column(Integer)
    applied_at: Mapped[datetime] = mapped_column(default=utcnow)


class TraceCapture(Timestamped, Base):
    """An opt-in live trace capture of one pool (optionally one tenant's requests).

    Invariants: at most one ``active`` capture per pool (partial unique index);
    ``0 < sample_rate <= 1``; ``max_bytes >= 1``. ``key`` is a per-capture secret (hex)
    the gateway keys the sampling and the block-id mapping with, so ids of two captures
    cannot be joined; it never leaves the server (not in the admin API, not in audit).
    """

    __tablename__ = "trace_captures"
    __table_args__ = (
        CheckConstraint("state IN ('active', 'stopped')", name="state_enum"),
        CheckConstraint("sample_rate > 0 AND sample_rate <= 1", name="sample_rate_range"),
        CheckConstraint("max_bytes >= 1", name="max_bytes_pos"),
        Index("uq_trace_captures_active_pool", "pool_id", unique=True,
              sqlite_where=text("state = 'active'"), postgresql_where=text("state = 'active'")),
        NEVER_REUSED_IDS,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    sample_rate: Mapped[float] = mapped_column(Float)
    max_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="active")
    key: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column()


class StoredResponse(Base):
    """A stored OpenAI Responses-API response (``store: true``), readable by its tenant only.

    ``input_items`` are this request's input items (each with its ``id``), ``output_items``
    the response's output items; a continuation (``previous_response_id``) rebuilds its
    prompt from the chain of these. ``body`` is the response object without ``output``.
    ``previous_response_id`` is not a foreign key: an ancestor may expire or be deleted
    before its descendants, and a continuation then fails with "not found", as OpenAI's does.
    ``size_bytes`` is what the row counts against the tenant's byte cap (its JSON's length,
    the prompt blocks included). ``root_id`` is the id of the response its conversation started
    with (its own for a first turn) and ``prompt_blocks`` the salted hashes of its prompt's full
    blocks as the engine saw them: a delete on any gateway finds from these which blocks other
    live responses of the conversation still hold (NULL in rows stored before they existed).
    """

    __tablename__ = "stored_responses"
    __table_args__ = (
        CheckConstraint("size_bytes >= 0", name="size_bytes_nonneg"),
        Index("ix_stored_responses_tenant_expires", "tenant_id", "expires_at"),
        Index("ix_stored_responses_tenant_root", "tenant_id", "root_id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(256))
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    output_items: Mapped[list[Any]] = mapped_column(JSON)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()
    root_id: Mapped[str | None] = mapped_column(String(64))
    prompt_blocks: Mapped[list[int] | None] = mapped_column(JSON)
