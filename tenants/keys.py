"""API keys: ``kvg_<prefix>_<secret>``, stored as HMAC-SHA256(pepper, secret).

Invariants:

* the plaintext exists only in the return value of ``create_key``; it is never
  stored, logged, or placed in an audit event (the prefix is, it is not secret);
* ``prefix`` is 8 chars of ``[a-z0-9]`` (unique, the lookup index); ``secret`` is
  43 URL-safe chars (``secrets.token_urlsafe(32)``, 256 bits);
* a key is checked by prefix lookup then ``hmac.compare_digest`` of the hashes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import string
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tenants import audit
from tenants import validation as v
from tenants.common import Page, get_by_ref, mutation, paginate, snapshot, storable_id
from tenants.errors import Conflict, InvalidField, NotFound
from tenants.models import ApiKey, Tenant

log = logging.getLogger("kvgate.tenants.keys")

KEY_SCHEME = "kvg"
PREFIX_LEN = 8
MIN_SECRET_LEN = 32
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
_SECRET_ALPHABET = frozenset(string.ascii_letters + string.digits + "-_")
SECRET_FIELDS = ("secret_hash",)


@dataclass(frozen=True, slots=True)
class ParsedKey:
    prefix: str
    secret: str

    def __repr__(self) -> str:  # never let a traceback or log print the secret
        return f"ParsedKey(prefix={self.prefix!r}, secret=<redacted>)"


def parse_key(plaintext: str, *, scheme: str = KEY_SCHEME) -> ParsedKey | None:
    """Split ``<scheme>_<prefix>_<secret>`` (``kvg`` keys, ``kva`` admin credentials); None
    for anything not shaped like one."""
    if not isinstance(plaintext, str) or len(plaintext) > 512:
        return None
    head = f"{scheme}_"
    if not plaintext.startswith(head):
        return None
    rest = plaintext[len(head) :]
    prefix, sep, secret = rest[:PREFIX_LEN], rest[PREFIX_LEN : PREFIX_LEN + 1], rest[PREFIX_LEN + 1 :]
    if sep != "_" or len(prefix) != PREFIX_LEN or any(c not in _PREFIX_ALPHABET for c in prefix):
        return None
    if len(secret) < MIN_SECRET_LEN or any(c not in _SECRET_ALPHABET for c in secret):
        return None
    return ParsedKey(prefix=prefix, secret=secret)


def hash_secret(secret: str, *, pepper: str) -> str:
    return hmac.new(pepper.encode(), secret.encode(), hashlib.sha256).hexdigest()


def new_prefix() -> str:
    return "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LEN))


def _new_key(scheme: str = KEY_SCHEME) -> tuple[str, str, str]:
    prefix = new_prefix()
    secret = secrets.token_urlsafe(32)
    return prefix, secret, f"{scheme}_{prefix}_{secret}"


def audit_view(key: ApiKey) -> dict[str, object]:
    return snapshot(key, exclude=SECRET_FIELDS)


def create_key(
    session: Session,
    *,
    actor: str,
    now: datetime,
    tenant: int | str,
    pepper: str,
    name: str = "",
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns the row and the plaintext (shown once)."""
    if not pepper:
        raise InvalidField("the key pepper is not configured", field="pepper")
    name = v.text(name, field="name", max_len=128, allow_empty=True)
    if expires_at is not None:
        expires_at = v.future_utc(expires_at, now=now, field="expires_at")
    for _attempt in range(5):  # prefix collisions are ~1 in 2.8e12; retry, never reuse
        prefix, secret, plaintext = _new_key()
        if session.scalars(select(ApiKey.id).where(ApiKey.prefix == prefix)).first() is None:
            break
    else:  # pragma: no cover - astronomically unlikely
        raise Conflict("could not allocate a unique key prefix; retry")
    with mutation(session, unique_field="prefix", entity="api key"):
        owner = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant")
        key = ApiKey(
            tenant_id=owner.id,
            prefix=prefix,
            secret_hash=hash_secret(secret, pepper=pepper),
            name=name,
            created_at=now,
            expires_at=expires_at,
        )
        session.add(key)
        session.flush()
        audit.record(
            session,
            actor=actor,
            action="api_key.create",
            entity_type="api_key",
            entity_id=key.id,
            before=None,
            after=audit_view(key),
            now=now,
        )
    log.info("api key created: tenant=%s key_id=%s prefix=%s", owner.slug, key.id, key.prefix)
    return key, plaintext


def list_keys(
    session: Session, *, tenant: int | str, limit: int = 50, offset: int = 0, include_revoked: bool = True
) -> Page[ApiKey]:
    owner = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant")
    stmt = select(ApiKey).where(ApiKey.tenant_id == owner.id)
    if not include_revoked:
        stmt = stmt.where(ApiKey.revoked_at.is_(None))
    return paginate(session, stmt.order_by(ApiKey.id), limit=limit, offset=offset)


def revoke_key(session: Session, *, actor: str, now: datetime, tenant: int | str, key_id: int) -> ApiKey:
    """Revoke a key of ``tenant``. Revoking a revoked key changes and records nothing."""
    with mutation(session, entity="api key"):
        owner = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant")
        # An id no key can have (outside INT32) is not found, without a query.
        key = session.get(ApiKey, key_id) if storable_id(key_id) else None
        if key is None or key.tenant_id != owner.id:
            raise NotFound(f"api key {str(key_id)[:80]} of tenant {owner.slug!r} does not exist",
                           code="api_key_not_found")
        if key.revoked_at is not None:
            return key
        before = audit_view(key)
        # Conditional UPDATE: of two concurrent revokes only one changes the row and audits.
        result = session.execute(
            update(ApiKey)
            .where(ApiKey.id == key.id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=now)
            .execution_options(synchronize_session=False)
        )
        session.refresh(key)
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return key
        audit.record(
            session,
            actor=actor,
            action="api_key.revoke",
            entity_type="api_key",
            entity_id=key.id,
            before=before,
            after=audit_view(key),
            now=now,
        )
    log.info("api key revoked: tenant=%s key_id=%s prefix=%s", owner.slug, key.id, key.prefix)
    return key
