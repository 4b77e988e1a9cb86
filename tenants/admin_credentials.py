"""Admin credentials: ``kva_<prefix>_<secret>`` with a role and an optional tenant scope.

Stored like API keys (``tenants.keys``): HMAC-SHA256(pepper, secret), the plaintext only in
the return value of ``create_credential`` / ``rotate_credential``, never in audit events.

Invariants:

* ``role`` is one of ``ADMIN_ROLES``; a ``tenant-admin`` is scoped to >= 1 tenant, a
  ``viewer`` may be, ``platform-admin`` and ``operator`` never are;
* a rotation keeps the prefix and the row, stores a new hash, and accepts the old secret
  until ``previous_valid_until`` (the overlap), then refuses it;
* ``authenticate_credential`` reads the registry on every call (no cache): a revocation or
  an expiry is seen by every gateway replica on the next request. It does one indexed
  query and two HMAC comparisons whatever the outcome.
* its audit actor is ``cred:<id>:<name>`` (``actor_of``): the id comes first, so two
  credentials never share an actor, however the 128-char column truncates their names;
* a name holds no control, format (bidi overrides, zero-width) or line/paragraph separator
  character (``_check_name``): what an audit reader sees is what was stored;
* every audit event of a credential carries its scope as it was (``tenants``: slugs, or
  None for an unscoped one).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from tenants import audit
from tenants import validation as v
from tenants.common import Page, get_by_ref, mutation, paginate, snapshot, storable_id
from tenants.errors import Conflict, InvalidField, NotFound
from tenants.keys import hash_secret, new_prefix, parse_key
from tenants.models import ADMIN_ROLES, AdminCredential, AdminCredentialTenant, Tenant

SCHEME = "kva"
SECRET_FIELDS = ("secret_hash", "previous_secret_hash")
MAX_OVERLAP_SECONDS = 7 * 24 * 3600
# last_used_at is written at most this often per credential (a GET should rarely write).
LAST_USED_RESOLUTION = timedelta(seconds=1)
_DUMMY_SECRET = "x" * 43
_DUMMY_HASH = "0" * 64


@dataclass(frozen=True, slots=True)
class AdminIdentity:
    """Who is calling: ``tenant_ids``/``tenants`` are None when unscoped."""

    name: str
    role: str
    tenant_ids: frozenset[int] | None
    tenants: tuple[str, ...] | None
    actor: str = ""
    credential_id: int | None = None


def actor_of(row: AdminCredential) -> str:
    """The audit actor of a credential's calls: unique by its id, whatever the name's length."""
    return f"cred:{row.id}:{row.name}"[:128]


def audit_view(row: AdminCredential, tenants: list[str] | None = None) -> dict[str, object]:
    out = snapshot(row, exclude=SECRET_FIELDS)
    out["tenants"] = tenants
    return out


def current_scope(session: Session, row: AdminCredential) -> list[str] | None:
    """The credential's scope for its audit events: slugs, or None when unscoped."""
    return scope_of(session, row.id) if row.scoped else None


def scope_of(session: Session, credential_id: int) -> list[str]:
    """Slugs of the credential's tenants, ordered."""
    return list(session.scalars(
        select(Tenant.slug).join(AdminCredentialTenant, AdminCredentialTenant.tenant_id == Tenant.id)
        .where(AdminCredentialTenant.credential_id == credential_id).order_by(Tenant.slug)
    ))


def _check_name(name: str) -> str:
    name = v.text(name, field="name", max_len=128)
    bad = v.first_unprintable(name)
    if bad is not None:
        raise InvalidField(f"name must not contain control or formatting characters (found U+{ord(bad):04X})",
                           field="name")
    return name


def _check_scope(role: str, tenants: list[str] | None) -> None:
    if tenants is not None and not tenants:
        raise InvalidField("tenants must name at least one tenant (omit it for an unscoped viewer)", field="tenants")
    if role == "tenant-admin" and not tenants:
        raise InvalidField("a tenant-admin credential needs at least one tenant", field="tenants")
    if role in ("platform-admin", "operator") and tenants is not None:
        raise InvalidField(f"a {role} credential is not scoped to tenants", field="tenants")


def create_credential(
    session: Session, *, actor: str, now: datetime, name: str, role: str, pepper: str,
    tenants: list[str] | None = None, expires_at: datetime | None = None,
) -> tuple[AdminCredential, list[str] | None, str]:
    """Create a credential; returns the row, its scope (slugs or None) and the plaintext (shown once)."""
    if not pepper:
        raise InvalidField("the key pepper is not configured", field="pepper")
    name = _check_name(name)
    role = v.choice(role, field="role", options=ADMIN_ROLES)
    _check_scope(role, tenants)
    if expires_at is not None:
        expires_at = v.future_utc(expires_at, now=now, field="expires_at")
    prefix = _free_prefix(session)
    secret = secrets.token_urlsafe(32)
    with mutation(session, unique_field="name", entity="admin credential"):
        # one row per tenant, however it was named (slug and id of one tenant are one scope)
        owners = list({t.id: t for t in (get_by_ref(session, Tenant, ref, name_attr="slug", what="tenant",
                                                    field="tenants") for ref in tenants or ())}.values())
        row = AdminCredential(
            name=name, role=role, scoped=tenants is not None, prefix=prefix,
            secret_hash=hash_secret(secret, pepper=pepper), created_by=actor[:128], created_at=now,
            expires_at=expires_at,
        )
        session.add(row)
        session.flush()
        session.add_all(AdminCredentialTenant(credential_id=row.id, tenant_id=t.id) for t in owners)
        scope = sorted(t.slug for t in owners) if tenants is not None else None
        audit.record(session, actor=actor, action="admin_credential.create", entity_type="admin_credential",
                     entity_id=row.id, before=None, after=audit_view(row, scope), now=now)
    return row, scope, f"{SCHEME}_{prefix}_{secret}"


def release_tenant(session: Session, *, actor: str, now: datetime, tenant: Tenant) -> None:
    """Before ``tenant`` is deleted (inside the delete's ``mutation``): refuse (409
    ``tenant_orphans_credential``, naming them) while a scoped credential that is not revoked has
    it as its only tenant — the delete would leave it valid and scoped to nothing (the rule
    ``kvgate admin apply --prune`` keeps, ``prune_orphans_credential``); a scoped credential
    with other tenants loses this one, recorded as ``admin_credential.update`` (scope before and
    after). The scope rows themselves go with the tenant (FK ``CASCADE``)."""
    holders = session.scalars(
        select(AdminCredential).join(AdminCredentialTenant, AdminCredentialTenant.credential_id == AdminCredential.id)
        .where(AdminCredentialTenant.tenant_id == tenant.id).order_by(AdminCredential.id)
    ).all()
    scopes = {row.id: scope_of(session, row.id) for row in holders}
    orphaned = [row for row in holders if row.revoked_at is None and scopes[row.id] == [tenant.slug]]
    if orphaned:
        listed = "; ".join(f"{row.name!r} (id {row.id}, {row.role})" for row in orphaned)
        raise Conflict(
            f"tenant {tenant.slug!r} is the only tenant of admin credential(s) {listed}: deleting it would leave "
            "them valid and scoped to no tenant; nothing was changed. Revoke them first "
            "(DELETE /admin/v1/credentials/<id>, kvgate admin credentials revoke <id>)",
            code="tenant_orphans_credential")
    for row in holders:
        before = scopes[row.id]
        audit.record(session, actor=actor, action="admin_credential.update", entity_type="admin_credential",
                     entity_id=row.id, before=audit_view(row, before),
                     after=audit_view(row, [slug for slug in before if slug != tenant.slug]), now=now)


def _free_prefix(session: Session) -> str:
    for _attempt in range(5):  # collisions are ~1 in 2.8e12; retry, never reuse
        prefix = new_prefix()
        if session.scalars(select(AdminCredential.id).where(AdminCredential.prefix == prefix)).first() is None:
            return prefix
    raise Conflict("could not allocate a unique credential prefix; retry")  # pragma: no cover


def list_credentials(session: Session, *, limit: int = 50, offset: int = 0) -> Page[AdminCredential]:
    return paginate(session, select(AdminCredential).order_by(AdminCredential.id), limit=limit, offset=offset)


def get_credential(session: Session, *, credential_id: int) -> AdminCredential:
    """The credential, else not found; an id no credential can have (outside INT32) is not
    found without a query."""
    row = session.get(AdminCredential, credential_id) if storable_id(credential_id) else None
    if row is None:
        raise NotFound(f"admin credential {str(credential_id)[:80]} does not exist",
                       code="admin_credential_not_found")
    return row


def revoke_credential(session: Session, *, actor: str, now: datetime, credential_id: int) -> AdminCredential:
    """Revoke at once (the old secret of a rotation too). Revoking twice records nothing."""
    with mutation(session, entity="admin credential"):
        row = get_credential(session, credential_id=credential_id)
        if row.revoked_at is not None:
            return row
        scope = current_scope(session, row)
        before = audit_view(row, scope)
        result = session.execute(
            update(AdminCredential).where(AdminCredential.id == row.id, AdminCredential.revoked_at.is_(None))
            .values(revoked_at=now).execution_options(synchronize_session=False)
        )
        session.refresh(row)
        if result.rowcount == 1:  # type: ignore[attr-defined]
            audit.record(session, actor=actor, action="admin_credential.revoke", entity_type="admin_credential",
                         entity_id=row.id, before=before, after=audit_view(row, scope), now=now)
    return row


def rotate_credential(
    session: Session, *, actor: str, now: datetime, credential_id: int, overlap_seconds: int, pepper: str
) -> tuple[AdminCredential, str]:
    """A new secret for the same credential; the current one stays valid ``overlap_seconds`` more."""
    overlap = v.integer(overlap_seconds, field="overlap_seconds", minimum=0, maximum=MAX_OVERLAP_SECONDS)
    secret = secrets.token_urlsafe(32)
    with mutation(session, entity="admin credential"):
        row = get_credential(session, credential_id=credential_id)
        if row.revoked_at is not None:
            raise Conflict("a revoked credential cannot be rotated", code="credential_revoked")
        scope = current_scope(session, row)
        before = audit_view(row, scope)
        row.previous_secret_hash = row.secret_hash
        row.previous_valid_until = now + timedelta(seconds=overlap)
        row.secret_hash = hash_secret(secret, pepper=pepper)
        session.flush()
        audit.record(session, actor=actor, action="admin_credential.rotate", entity_type="admin_credential",
                     entity_id=row.id, before=before, after=audit_view(row, scope), now=now)
    return row, f"{SCHEME}_{row.prefix}_{secret}"


def authenticate_credential(session: Session, *, plaintext: str, pepper: str, now: datetime) -> AdminIdentity | None:
    """The identity behind a ``kva_...`` secret, or None (unknown, wrong, revoked, expired).

    Touches ``last_used_at`` (at most once per ``LAST_USED_RESOLUTION``) and commits.
    """
    parsed = parse_key(plaintext, scheme=SCHEME)
    row = None
    if parsed is not None:
        row = session.scalars(select(AdminCredential).where(AdminCredential.prefix == parsed.prefix)).one_or_none()
    candidate = hash_secret(parsed.secret if parsed else _DUMMY_SECRET, pepper=pepper)
    current = hmac.compare_digest(candidate, row.secret_hash if row is not None else _DUMMY_HASH)
    previous = hmac.compare_digest(candidate, (row.previous_secret_hash if row is not None else None) or _DUMMY_HASH)
    if row is None or not (current or (previous and row.previous_valid_until is not None
                                       and now < row.previous_valid_until)):
        return None
    if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
        return None
    tenant_ids = scope = None
    if row.scoped:
        pairs = session.execute(
            select(Tenant.id, Tenant.slug).join(AdminCredentialTenant, AdminCredentialTenant.tenant_id == Tenant.id)
            .where(AdminCredentialTenant.credential_id == row.id).order_by(Tenant.slug)
        ).all()
        tenant_ids, scope = frozenset(p.id for p in pairs), tuple(p.slug for p in pairs)
    session.execute(
        update(AdminCredential)
        .where(AdminCredential.id == row.id, or_(AdminCredential.last_used_at.is_(None),
                                                 AdminCredential.last_used_at < now - LAST_USED_RESOLUTION))
        .values(last_used_at=now).execution_options(synchronize_session=False)
    )
    session.commit()
    return AdminIdentity(name=row.name, role=row.role, tenant_ids=tenant_ids, tenants=scope,
                         actor=actor_of(row), credential_id=row.id)
