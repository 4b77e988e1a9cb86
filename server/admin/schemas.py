"""Admin API schemas: ``XCreate`` / ``XUpdate`` / ``XPublic`` per resource.

Create/Update forbid unknown fields (so ``cache_salt`` or a typo is a 422 naming the
field). Bounds here mirror ``tenants.validation`` so OpenAPI documents them; the
services re-check, so the CLI gets the same rules. No schema exposes ``cache_salt``
or a key hash; the key plaintext appears only in ``ApiKeyCreated``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tenants.validation import ENDPOINT_PATTERN

Priority = Annotated[int, Field(strict=True, ge=0, le=100, description="TensorRT-LLM retention priority, 0..100")]
# INT32 like the engine contract's retention_*_duration_ms tensors (engines/contract.py): at most ~24.8 days.
Duration = Annotated[
    int | None, Field(strict=True, ge=0, le=2**31 - 1, description="milliseconds; null = never expires")
]
Name = Annotated[
    str,
    Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$", description="lowercase name, not all digits"),
]
Ref = Annotated[int | str, Field(description="id or name")]
PositiveInt = Annotated[int, Field(strict=True, ge=1, le=2**31 - 1)]
Version = Annotated[int, Field(strict=True, description="the current version (optimistic concurrency)")]
Isolation = Literal["shared", "salted", "dedicated"]
ReplicaState = Literal["active", "draining", "disabled"]
Endpoint = Annotated[
    str, Field(min_length=3, max_length=256, pattern=ENDPOINT_PATTERN, description="gRPC host:port of the engine")
]
Weight = Annotated[int, Field(strict=True, ge=1, le=1000, description="relative share of the pool's traffic")]
RetentionMode = Literal["static", "adaptive"]

T = TypeVar("T")


BOOLEAN_FIELDS = frozenset({"hints_enabled", "conversation_hold_enabled", "conversation_end_demote_enabled"})


class Strict(BaseModel):
    """Request bodies: unknown fields are errors; no coercion of numbers (``true`` is not 1, ``"5"`` is not 5)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: object, info: ValidationInfo) -> object:
        # JSON true/false would otherwise pass as 1/0 (a priority, a quota of 1.0); a
        # field that *is* a flag (named in BOOLEAN_FIELDS) takes only true/false.
        if info.field_name in BOOLEAN_FIELDS:
            if not isinstance(value, bool) and value is not None:
                raise ValueError("must be true or false")
            return value
        if isinstance(value, bool):
            raise ValueError("a boolean is not accepted here")
        return value


class Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. duplicate, stale_version, unknown_pool")
    message: str
    field: str | None = Field(description="the offending field, when one is to blame")


class ErrorBody(BaseModel):
    """The one error shape of the admin API."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict] = {
    401: {"model": ErrorBody, "description": "missing, invalid, revoked or expired admin credential"},
    403: {"model": ErrorBody, "description": "the caller's role or tenant scope does not allow this "
                                             "(forbidden, no_rule, limit_above_cap, limit_not_capped, field_not_permitted)"},
    404: {"model": ErrorBody, "description": "no such pool/replica/class/tenant/key/credential (a tenant outside "
                                             "a scoped caller's scope is answered exactly as a missing one)"},
    409: {"model": ErrorBody, "description": "duplicate name, stale version, still in use, or a pool's last replica"},
    422: {"model": ErrorBody, "description": "invalid field (named in error.field)"},
    503: {"model": ErrorBody, "description": "registry database unavailable"},
}


class PageOf(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


# --- pools and their replicas -------------------------------------------------------------------


class ReplicaCreate(Strict):
    name: Name
    endpoint: Endpoint
    weight: Weight = 1
    state: ReplicaState = "active"


class ReplicaUpdate(Strict):
    version: Version
    endpoint: Endpoint | None = None
    weight: Weight | None = None
    state: ReplicaState | None = None


class ReplicaPublic(Public):
    id: int
    pool_id: int
    name: str
    endpoint: str
    state: str
    weight: int
    version: Version
    created_at: datetime
    updated_at: datetime


class PoolCreate(Strict):
    """A pool with ``replicas`` (at least one), or the legacy ``triton_url`` = one replica ``r0``."""

    name: Name
    model_name: str = Field(min_length=1, max_length=128, description="what /v1/models shows")
    replicas: list[ReplicaCreate] | None = Field(
        None, min_length=1, max_length=256, description="the pool's engine endpoints (give this or triton_url)"
    )
    triton_url: Endpoint | None = Field(
        None, description="legacy: one active replica named r0 at this host:port (give this or replicas)"
    )
    triton_model: str = Field("kvgate_llm", min_length=1, max_length=128)
    engine_spec: str = Field("", max_length=128)
    tokens_per_block: int = Field(32, strict=True, ge=1, le=4096)
    primary_blocks: PositiveInt
    secondary_blocks: int = Field(0, strict=True, ge=0, le=2**31 - 1)
    secondary_offload_min_priority: Priority = 35


class PoolUpdate(Strict):
    """Pool fields; replicas change through ``/pools/{ref}/replicas``."""

    version: Version
    name: Name | None = None
    model_name: str | None = Field(None, min_length=1, max_length=128)
    triton_model: str | None = Field(None, min_length=1, max_length=128)
    engine_spec: str | None = Field(None, max_length=128)
    tokens_per_block: int | None = Field(None, strict=True, ge=1, le=4096)
    primary_blocks: PositiveInt | None = None
    secondary_blocks: int | None = Field(None, strict=True, ge=0, le=2**31 - 1)
    secondary_offload_min_priority: Priority | None = None


class EngineReportedPublic(BaseModel):
    """What the pool's engine allocated, from the gateway's latest stats poll."""

    primary_blocks: int
    secondary_blocks: int
    tokens_per_block: int
    mismatch: bool = Field(description="true when any of these differs from the registered value; "
                                       "quota arithmetic then uses the engine's figures")


class PoolPublic(Public):
    id: int
    name: str
    model_name: str
    triton_url: str = Field(description="legacy: the first active replica's endpoint (else the first replica's)")
    replicas: list[ReplicaPublic]
    triton_model: str
    engine_spec: str
    tokens_per_block: int
    primary_blocks: int
    secondary_blocks: int
    secondary_offload_min_priority: int
    version: Version
    created_at: datetime
    updated_at: datetime
    engine_reported: EngineReportedPublic | None = Field(
        None, description="the engine's own block counts from the gateway's latest poll (null: not polled yet)")


# --- retention classes -----------------------------------------------------------------------


class RetentionClassCreate(Strict):
    name: Name
    description: str = Field("", max_length=2000)
    system_priority: Priority = 90
    system_duration_ms: Duration = None
    context_priority: Priority = 60
    context_duration_ms: Duration = 600_000
    turn_priority: Priority = 35
    turn_duration_ms: Duration = 30_000
    decode_priority: Priority = 35
    decode_duration_ms: Duration = 30_000
    mode: RetentionMode = "static"
    hints_enabled: bool = Field(False, description="honour client cache hints (cache_control, prompt_cache_retention)")
    hint_max_ttl_ms: int = Field(3_600_000, gt=0, le=2**31 - 1, description="longest duration a hint may ask for")
    hint_max_priority: Priority = Field(60, description="the priority hinted tokens get (at most)")
    hint_quota_fraction: float = Field(0.5, gt=0, le=1, description="share of the tenant's KV quota hinted blocks may hold")
    conversation_hold_enabled: bool = Field(
        False, description="hold tool loops and stored Responses conversations for their measured gap (within the "
        "hint caps), and demote a deleted stored conversation's blocks")
    conversation_end_demote_enabled: bool = Field(
        False, description="when a stored Responses run that offered tools ends in a message, demote the "
        "conversation's own blocks to priority 0 (independent of conversation_hold_enabled; the switch for agent "
        "tool loops)")


class RetentionClassUpdate(Strict):
    version: Version
    name: Name | None = None
    description: str | None = Field(None, max_length=2000)
    system_priority: Priority | None = None
    system_duration_ms: Duration = None
    context_priority: Priority | None = None
    context_duration_ms: Duration = None
    turn_priority: Priority | None = None
    turn_duration_ms: Duration = None
    decode_priority: Priority | None = None
    decode_duration_ms: Duration = None
    mode: RetentionMode | None = None
    hints_enabled: bool | None = None
    hint_max_ttl_ms: int | None = Field(None, gt=0, le=2**31 - 1)
    hint_max_priority: Priority | None = None
    hint_quota_fraction: float | None = Field(None, gt=0, le=1)
    conversation_hold_enabled: bool | None = None
    conversation_end_demote_enabled: bool | None = None


class RetentionClassPublic(Public):
    id: int
    name: str
    description: str
    system_priority: int
    system_duration_ms: int | None
    context_priority: int
    context_duration_ms: int | None
    turn_priority: int
    turn_duration_ms: int | None
    decode_priority: int
    decode_duration_ms: int | None
    mode: str
    hints_enabled: bool
    hint_max_ttl_ms: int
    hint_max_priority: int
    hint_quota_fraction: float
    conversation_hold_enabled: bool
    conversation_end_demote_enabled: bool
    version: Version
    created_at: datetime
    updated_at: datetime


# --- tenants ----------------------------------------------------------------------------------


class LimitCaps(Strict):
    """The highest value a tenant-admin may set per limit; a limit without a cap is fixed for it."""

    kv_quota_fraction: float | None = Field(None, gt=0, le=1)
    rpm_limit: PositiveInt | None = None
    tpm_limit: PositiveInt | None = None
    max_concurrent_requests: PositiveInt | None = None
    max_prompt_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None


class TenantCreate(Strict):
    slug: Name
    display_name: str = Field(min_length=1, max_length=256)
    pool: Ref
    retention_class: Ref
    isolation: Isolation = "salted"
    kv_quota_fraction: float = Field(0.5, gt=0, le=1)
    rpm_limit: PositiveInt = 600
    tpm_limit: PositiveInt = 200_000
    max_concurrent_requests: PositiveInt = 16
    max_prompt_tokens: PositiveInt = 8192
    max_output_tokens: PositiveInt = 1024
    limit_caps: LimitCaps | None = Field(None, description="caps for a tenant-admin's own limit changes")


class TenantUpdate(Strict):
    version: Version
    display_name: str | None = Field(None, min_length=1, max_length=256)
    pool: Ref | None = None
    retention_class: Ref | None = None
    isolation: Isolation | None = None
    kv_quota_fraction: float | None = Field(None, gt=0, le=1)
    rpm_limit: PositiveInt | None = None
    tpm_limit: PositiveInt | None = None
    max_concurrent_requests: PositiveInt | None = None
    max_prompt_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None
    limit_caps: LimitCaps | None = Field(None, description="platform-admin only; null clears every cap")


class StatusChange(Strict):
    version: Version | None = Field(None, description="optional optimistic-concurrency check")


class TenantPublic(Public):
    id: int
    slug: str
    display_name: str
    status: str
    pool_id: int
    pool: str
    retention_class_id: int
    retention_class: str
    isolation: str
    kv_quota_fraction: float
    rpm_limit: int
    tpm_limit: int
    max_concurrent_requests: int
    max_prompt_tokens: int
    max_output_tokens: int
    limit_caps: dict[str, float | int] | None = None
    version: Version
    created_at: datetime
    updated_at: datetime


class SegmentViewPublic(Public):
    segment: str
    priority: int
    duration_ms: int | None
    tier_on_eviction: Literal["host", "dropped"]


class RetentionViewPublic(BaseModel):
    tenant: str
    pool: str
    secondary_offload_min_priority: int
    secondary_blocks: int
    segments: list[SegmentViewPublic]


class TenantDetail(TenantPublic):
    retention_view: list[SegmentViewPublic]


# --- API keys --------------------------------------------------------------------------------


class ApiKeyCreate(Strict):
    name: str = Field("", max_length=128)
    expires_at: datetime | None = Field(None, description="timezone-aware; null = never")


class ApiKeyPublic(Public):
    id: int
    tenant_id: int
    prefix: str
    name: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyPublic):
    key: str = Field(description="the plaintext key; shown once, never retrievable again")


# --- audit and usage -------------------------------------------------------------------------


class AuditEventPublic(Public):
    id: int
    at: datetime
    actor: str
    action: str
    entity_type: str
    entity_id: str
    before: dict | None
    after: dict | None


_CACHE_READ = "prompt tokens served from the KV cache (the APIs' cached_tokens / cache_read_input_tokens)"
_CACHE_WRITE = "prompt tokens kept under a client cache hint of {} (Messages' cache_creation.ephemeral_{}_input_tokens)"


class UsageTotalsPublic(Public):
    """A tenant's counters; the three cache counts are of its prompt tokens (together at most them)."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int = Field(description=_CACHE_READ)
    cache_write_5m_tokens: int = Field(description=_CACHE_WRITE.format("less than 1 h", "5m"))
    cache_write_1h_tokens: int = Field(description=_CACHE_WRITE.format("1 h or more", "1h"))


class UsageMinutePublic(Public):
    minute: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int = Field(description=_CACHE_READ)
    cache_write_5m_tokens: int = Field(description=_CACHE_WRITE.format("less than 1 h", "5m"))
    cache_write_1h_tokens: int = Field(description=_CACHE_WRITE.format("1 h or more", "1h"))


class UsageReportPublic(BaseModel):
    tenant: str
    start: datetime | None
    end: datetime | None
    total: UsageTotalsPublic
    items: list[UsageMinutePublic]
    total_minutes: int
    limit: int
    offset: int
