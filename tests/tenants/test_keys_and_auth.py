"""API keys and the gateway-facing service functions (authenticate, touch, snapshots)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from sqlalchemy import select

from tenants import (
    authenticate_key,
    keys,
    list_active_tenants_by_pool,
    list_active_tenants_for_pool,
    list_pool_snapshots,
    tenant,
    touch_keys_last_used,
)
from tenants.errors import InvalidField, NotFound
from tenants.keys import hash_secret, parse_key
from tenants.models import ApiKey
from tests.tenants.factories import ACTOR, make_class, make_placement, make_pool, make_tenant, now

PEPPER = "pepper-for-tests-0123456789abcdef"
KEY_RE = re.compile(r"^kvg_[a-z0-9]{8}_[A-Za-z0-9_-]{32,}$")


def _key(session, tenant_ref="acme", **kw):  # type: ignore[no-untyped-def]
    return keys.create_key(session, actor=ACTOR, now=now(), tenant=tenant_ref, pepper=PEPPER, **kw)


def test_key_format_and_storage(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    row, plaintext = _key(session, name="ci")
    assert KEY_RE.match(plaintext)
    parsed = parse_key(plaintext)
    assert parsed is not None and parsed.prefix == row.prefix and parsed.secret not in repr(parsed)
    stored = session.scalars(select(ApiKey)).one()
    assert stored.secret_hash == hash_secret(parsed.secret, pepper=PEPPER)
    assert parsed.secret not in stored.secret_hash


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "kvg_",
        "sk-abc",
        "kvg_ABCDEFGH_" + "a" * 40,
        "kvg_abcdefgh_short",
        "kvg_abcdefgh-" + "a" * 40,
        "kvg_abcdefgh_" + "a" * 40 + "!",
        "x" * 5000,
    ],
)
def test_malformed_keys_do_not_parse(bad: str) -> None:
    assert parse_key(bad) is None


def test_authenticate_returns_full_snapshot(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session, secondary_offload_min_priority=40, tokens_per_block=64)
    make_class(session, turn_priority=20, turn_duration_ms=5000, decode_priority=10, decode_duration_ms=None)
    t = make_tenant(session, isolation="salted", kv_quota_fraction=0.25, rpm_limit=7)
    row, plaintext = _key(session)
    auth = authenticate_key(session, plaintext=plaintext, pepper=PEPPER, now=now())
    assert auth is not None and auth.usable
    assert (auth.tenant_id, auth.slug, auth.key_id, auth.cache_salt) == (t.id, "acme", row.id, t.cache_salt)
    assert (auth.limits.rpm, auth.kv_quota_fraction, auth.isolation) == (7, 0.25, "salted")
    assert (auth.pool.name, auth.pool.tokens_per_block, auth.pool.secondary_offload_min_priority) == ("gpu-a", 64, 40)
    assert (auth.pool.triton_model, auth.pool.model_name) == ("kvgate_llm", "smollm2-135m")
    assert (auth.retention.turn.priority, auth.retention.turn.duration_ms) == (20, 5000)
    assert (auth.retention.decode.priority, auth.retention.decode.duration_ms) == (10, None)
    assert t.cache_salt not in repr(auth)
    with pytest.raises(AttributeError):
        auth.slug = "other"  # frozen


def test_authenticate_rejects_wrong_secret_wrong_pepper_unknown_prefix(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    _row, plaintext = _key(session)
    head, secret = plaintext[:13], plaintext[13:]
    flipped = head + ("A" if secret[0] != "A" else "B") + secret[1:]
    assert authenticate_key(session, plaintext=flipped, pepper=PEPPER, now=now()) is None
    assert authenticate_key(session, plaintext=plaintext, pepper=PEPPER + "x", now=now()) is None
    assert authenticate_key(session, plaintext="kvg_zzzzzzzz_" + secret, pepper=PEPPER, now=now()) is None
    assert authenticate_key(session, plaintext="garbage", pepper=PEPPER, now=now()) is None


def test_revoked_expired_suspended_resolve_to_unusable(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    t0 = now()
    revoked, revoked_pt = _key(session)
    expiring, expiring_pt = _key(session, expires_at=t0 + timedelta(minutes=5))
    keys.revoke_key(session, actor=ACTOR, now=now(), tenant="acme", key_id=revoked.id)
    a = authenticate_key(session, plaintext=revoked_pt, pepper=PEPPER, now=t0)
    assert a is not None and a.key_revoked and not a.usable
    b = authenticate_key(session, plaintext=expiring_pt, pepper=PEPPER, now=t0)
    assert b is not None and b.usable
    c = authenticate_key(session, plaintext=expiring_pt, pepper=PEPPER, now=t0 + timedelta(minutes=5))
    assert c is not None and c.key_expired and not c.usable
    tenant.suspend_tenant(session, actor=ACTOR, now=now(), ref="acme")
    d = authenticate_key(session, plaintext=expiring_pt, pepper=PEPPER, now=t0)
    assert d is not None and d.status == "suspended" and not d.usable


def test_key_creation_rules(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InvalidField) as err:
        _key(session, expires_at=now() - timedelta(seconds=1))
    assert err.value.field == "expires_at"
    with pytest.raises(NotFound):
        _key(session, "ghost")
    with pytest.raises(InvalidField):
        keys.create_key(session, actor=ACTOR, now=now(), tenant="acme", pepper="")
    row, _ = _key(session)
    make_tenant(session, "other")
    with pytest.raises(NotFound):  # a key is revoked only through its own tenant
        keys.revoke_key(session, actor=ACTOR, now=now(), tenant="other", key_id=row.id)


def test_touch_keys_last_used_never_moves_backwards(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    k1, _ = _key(session)
    k2, _ = _key(session)
    t = now()
    assert touch_keys_last_used(session, key_ids=[k1.id, k2.id, k1.id], now=t) == 2
    assert touch_keys_last_used(session, key_ids=[k1.id], now=t - timedelta(seconds=10)) == 0
    assert touch_keys_last_used(session, key_ids=[], now=t) == 0
    session.expire_all()
    assert session.get(ApiKey, k1.id).last_used_at == t


def test_active_tenants_for_pool_and_pool_snapshots(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    make_pool(session, "gpu-b")
    make_class(session)
    a = make_tenant(session, "a", kv_quota_fraction=0.3)
    make_tenant(session, "b")
    make_tenant(session, "c", pool="gpu-b")
    tenant.suspend_tenant(session, actor=ACTOR, now=now(), ref="b")
    active = list_active_tenants_for_pool(session, pool_id=a.pool_id)
    assert [(s.slug, s.kv_quota_fraction, s.cache_salt) for s in active] == [("a", 0.3, a.cache_salt)]
    assert [p.name for p in list_pool_snapshots(session)] == ["gpu-a", "gpu-b"]
    # every pool at once (the gateway's pool poll): the same lists, suspended tenants left out
    by_pool = list_active_tenants_by_pool(session)
    assert by_pool == {p.id: list_active_tenants_for_pool(session, pool_id=p.id) for p in list_pool_snapshots(session)}
    assert [s.slug for s in by_pool[a.pool_id]] == ["a"]
