"""The SQL tenant registry: pools, retention classes, tenants, API keys, audit, usage.

Public surface for the gateway (all keyword-only after the session, DB-agnostic):

* ``authenticate_key(session, *, plaintext, pepper, now) -> AuthenticatedTenant | None``
* ``touch_keys_last_used(session, *, key_ids, now) -> int``
* ``list_active_tenants_for_pool(session, *, pool_id) -> list[TenantSummary]``
* ``list_active_tenants_by_pool(session) -> dict[int, list[TenantSummary]]`` (every pool, one query)
* ``list_pool_snapshots(session) -> list[PoolSnapshot]``
* ``record_usage(session, *, flush_id, rows, now=None) -> bool``

Admin writes live in ``tenants.pools``, ``tenants.replicas``, ``tenants.retention_classes``, ``tenants.tenant``
and ``tenants.keys``; each is one transaction with one audit event.
"""

from tenants.auth import authenticate_key, list_active_tenants_by_pool, list_active_tenants_for_pool, list_pool_snapshots, touch_keys_last_used
from tenants.db import DEFAULT_DATABASE_URL, make_engine, make_session_factory
from tenants.snapshots import (
    AuthenticatedTenant,
    PoolSnapshot,
    ReplicaSnapshot,
    RetentionClassSnapshot,
    SegmentRetention,
    TenantLimits,
    TenantSummary,
)
from tenants.usage import UsageRow, record_usage

__all__ = [
    "DEFAULT_DATABASE_URL",
    "AuthenticatedTenant",
    "PoolSnapshot",
    "ReplicaSnapshot",
    "RetentionClassSnapshot",
    "SegmentRetention",
    "TenantLimits",
    "TenantSummary",
    "UsageRow",
    "authenticate_key",
    "list_active_tenants_by_pool",
    "list_active_tenants_for_pool",
    "list_pool_snapshots",
    "make_engine",
    "make_session_factory",
    "record_usage",
    "touch_keys_last_used",
]
