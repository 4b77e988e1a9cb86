"""Service functions the gateway calls on its hot path (DB-agnostic, no audit).

``authenticate_key`` does one indexed query (key id and hash by prefix) and one HMAC;
on an unknown prefix or a malformed key it still computes an HMAC and a
``compare_digest`` so the work done does not reveal which check failed. Only a matching
secret loads the tenant, pool and retention class (a second query).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from tenants.keys import hash_secret, parse_key
from tenants.models import ApiKey, Pool, RetentionClass, Tenant
from tenants.snapshots import (
    AuthenticatedTenant,
    PoolSnapshot,
    RetentionClassSnapshot,
    TenantLimits,
    TenantSummary,
)

_DUMMY_SECRET = "x" * 43
_DUMMY_HASH = "0" * 64


def authenticate_key(session: Session, *, plaintext: str, pepper: str, now: datetime) -> AuthenticatedTenant | None:
    """Resolve an API key to a tenant snapshot, or None if it is not a valid key.

    The returned snapshot may be unusable (revoked/expired key, suspended tenant):
    check ``.usable``. ``now`` decides expiry (``expires_at <= now`` is expired).
    """
    parsed = parse_key(plaintext)
    # Why two queries: the first reads two columns by prefix, the same work whether the
    # prefix exists or not; only a key whose secret matches pays for loading its tenant,
    # pool and class. One join for every known prefix made "real prefix, wrong secret"
    # measurably slower than "unknown prefix" (an enumeration oracle; tests/reliability).
    found = None
    if parsed is not None:
        found = session.execute(
            select(ApiKey.id, ApiKey.secret_hash).where(ApiKey.prefix == parsed.prefix)
        ).one_or_none()
    candidate = hash_secret(parsed.secret if parsed else _DUMMY_SECRET, pepper=pepper)
    stored = found.secret_hash if found is not None else _DUMMY_HASH
    if not hmac.compare_digest(candidate, stored) or found is None:
        return None
    row = session.execute(
        select(ApiKey, Tenant, Pool, RetentionClass)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .join(Pool, Pool.id == Tenant.pool_id)
        .join(RetentionClass, RetentionClass.id == Tenant.retention_class_id)
        .where(ApiKey.id == found.id)
    ).one_or_none()
    if row is None:  # deleted between the two reads
        return None
    key, tenant, pool, cls = row
    return AuthenticatedTenant(
        tenant_id=tenant.id,
        slug=tenant.slug,
        status=tenant.status,
        isolation=tenant.isolation,
        cache_salt=tenant.cache_salt,
        limits=TenantLimits.of(tenant),
        kv_quota_fraction=tenant.kv_quota_fraction,
        pool=PoolSnapshot.of(pool),
        retention=RetentionClassSnapshot.of(cls),
        key_id=key.id,
        key_revoked=key.revoked_at is not None,
        key_expired=key.expires_at is not None and key.expires_at <= now,
    )


def touch_keys_last_used(session: Session, *, key_ids: Iterable[int], now: datetime) -> int:
    """Set ``last_used_at = now`` for the keys (never moves it backwards); commits; returns rows changed."""
    ids = sorted({int(k) for k in key_ids})
    if not ids:
        return 0
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.id.in_(ids), or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now))
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return int(result.rowcount)  # type: ignore[attr-defined]


def _summary(t: Tenant) -> TenantSummary:
    return TenantSummary(
        id=t.id, slug=t.slug, isolation=t.isolation, kv_quota_fraction=t.kv_quota_fraction, cache_salt=t.cache_salt
    )


def list_active_tenants_for_pool(session: Session, *, pool_id: int) -> list[TenantSummary]:
    """Active tenants placed on ``pool_id``, ordered by id."""
    rows = session.scalars(
        select(Tenant).where(Tenant.pool_id == pool_id, Tenant.status == "active").order_by(Tenant.id)
    ).all()
    return [_summary(t) for t in rows]


def list_active_tenants_by_pool(session: Session) -> dict[int, list[TenantSummary]]:
    """Active tenants of every pool, by pool id, each list ordered by tenant id: one query for
    every pool (the gateway's pool poll reads this every second)."""
    out: dict[int, list[TenantSummary]] = {}
    for t in session.scalars(select(Tenant).where(Tenant.status == "active").order_by(Tenant.id)).all():
        out.setdefault(t.pool_id, []).append(_summary(t))
    return out


def list_pool_snapshots(session: Session) -> list[PoolSnapshot]:
    """Every pool, ordered by id (the gateway builds one engine client per pool)."""
    return [PoolSnapshot.of(p) for p in session.scalars(select(Pool).order_by(Pool.id)).all()]
