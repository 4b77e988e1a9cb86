"""Every admin mutation leaves exactly one audit event (a tenant's delete: one more per row that goes
with it and has a history, e.g. its keys); a failed mutation leaves none."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from tenants import audit, tenant
from tenants.models import AuditEvent, Tenant
from tests.server.admin.conftest import AUTH
from tests.tenants.factories import ACTOR, make_placement, now

A = "/admin/v1"


def _count(client) -> int:  # type: ignore[no-untyped-def]
    return client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"]


def test_each_mutation_one_event_each_failure_none(client) -> None:  # type: ignore[no-untyped-def]
    ok = [
        (
            "post",
            "/pools",
            {"name": "gpu-a", "model_name": "m", "triton_url": "h:1", "primary_blocks": 8, "secondary_blocks": 8},
            "pool.create",
        ),
        ("patch", "/pools/gpu-a", {"version": 1, "primary_blocks": 16}, "pool.update"),
        ("post", "/retention-classes", {"name": "gold"}, "retention_class.create"),
        ("patch", "/retention-classes/gold", {"version": 1, "turn_priority": 50}, "retention_class.update"),
        (
            "post",
            "/tenants",
            {"slug": "acme", "display_name": "A", "pool": "gpu-a", "retention_class": "gold"},
            "tenant.create",
        ),
        ("patch", "/tenants/acme", {"version": 1, "tpm_limit": 1000}, "tenant.update"),
        ("post", "/tenants/acme/suspend", None, "tenant.suspend"),
        ("post", "/tenants/acme/resume", None, "tenant.resume"),
        ("post", "/tenants/acme/keys", {"name": "k"}, "api_key.create"),
        ("post", "/tenants/acme/keys/1/revoke", None, "api_key.revoke"),
        ("delete", "/tenants/acme", None, "tenant.delete"),
        ("delete", "/retention-classes/gold", None, "retention_class.delete"),
        ("delete", "/pools/gpu-a", None, "pool.delete"),
    ]
    failing = [
        ("post", "/pools", {"name": "x", "model_name": "m", "triton_url": "h:1", "primary_blocks": 0}),  # 422
        ("patch", "/pools/ghost", {"version": 1, "primary_blocks": 1}),  # 404
        ("delete", "/tenants/ghost", None),  # 404
        ("post", "/tenants/ghost/keys", {}),  # 404
        ("post", "/tenants/ghost/suspend", None),  # 404
    ]
    for step, (method, path, body, action) in enumerate(ok):
        # Interleave failures (cycling through them) that must not leave events.
        for fmethod, fpath, fbody in (failing[step % len(failing)],):
            before = _count(client)
            r = client.request(fmethod, f"{A}{fpath}", headers=AUTH, json=fbody)
            assert r.status_code in (404, 409, 422), r.text
            assert _count(client) == before
        before = _count(client)
        r = client.request(method, f"{A}{path}", headers=AUTH, json=body)
        assert r.status_code < 300, (path, r.text)
        # acme's one (revoked) key goes with it: api_key.delete, then tenant.delete
        assert _count(client) == before + (2 if action == "tenant.delete" else 1)
        latest = client.get(f"{A}/audit?limit=1", headers=AUTH).json()["items"][0]
        assert latest["action"] == action and latest["actor"] == "admin:ops"
        if action.endswith(".update"):
            assert latest["before"]["version"] + 1 == latest["after"]["version"]


def test_conflicting_mutations_leave_no_event(client) -> None:  # type: ignore[no-untyped-def]
    client.post(
        f"{A}/pools", headers=AUTH, json={"name": "p", "model_name": "m", "triton_url": "h:1", "primary_blocks": 1}
    )
    client.post(f"{A}/retention-classes", headers=AUTH, json={"name": "c"})
    client.post(
        f"{A}/tenants", headers=AUTH, json={"slug": "t", "display_name": "T", "pool": "p", "retention_class": "c"}
    )
    before = _count(client)
    for method, path, body in [
        ("post", "/pools", {"name": "p", "model_name": "m", "triton_url": "h:1", "primary_blocks": 1}),  # duplicate
        ("patch", "/tenants/t", {"version": 7, "rpm_limit": 1}),  # stale
        ("delete", "/pools/p", None),  # in use
        ("post", "/tenants/t/suspend", {"version": 9}),  # stale
    ]:
        assert client.request(method, f"{A}{path}", headers=AUTH, json=body).status_code == 409
    assert _count(client) == before


def test_change_and_event_share_one_transaction(db, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """If writing the event fails, the change is rolled back with it."""
    with db.factory() as s:
        make_placement(s)
        events = s.scalar(select(func.count()).select_from(AuditEvent))

    def broken_record(*_a, **_k):  # type: ignore[no-untyped-def]
        raise RuntimeError("audit sink down")

    monkeypatch.setattr(audit, "record", broken_record)
    with db.factory() as s, pytest.raises(RuntimeError):
        tenant.update_tenant(s, actor=ACTOR, now=now(), ref="acme", version=1, changes={"rpm_limit": 1})
    with db.factory() as s:
        row = s.scalars(select(Tenant)).one()
        assert (row.rpm_limit, row.version) == (600, 1)
        assert s.scalar(select(func.count()).select_from(AuditEvent)) == events


def test_audit_filters(client) -> None:  # type: ignore[no-untyped-def]
    client.post(
        f"{A}/pools", headers=AUTH, json={"name": "p", "model_name": "m", "triton_url": "h:1", "primary_blocks": 1}
    )
    client.post(f"{A}/retention-classes", headers=AUTH, json={"name": "c"})
    client.patch(f"{A}/pools/p", headers=AUTH, json={"version": 1, "primary_blocks": 2})
    pools = client.get(f"{A}/audit?entity_type=pool", headers=AUTH).json()
    assert [e["action"] for e in pools["items"]] == ["pool.update", "pool.create"]
    assert client.get(f"{A}/audit?action=retention_class.create", headers=AUTH).json()["total"] == 1
    assert client.get(f"{A}/audit?since=2999-01-01T00:00:00Z", headers=AUTH).json()["total"] == 0
    r = client.get(f"{A}/audit?since=2020-01-01T00:00:00", headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["field"] == "since"


def test_audit_shows_only_entities_the_callers_role_may_read(client) -> None:  # type: ignore[no-untyped-def]
    """GET /audit is no side door: credential events only to who may list credentials (platform
    admins), API key events only to who may read keys (not operators). Filtered in the query:
    every page is full and ``total`` counts only what the caller may read."""
    from tests.server.admin.conftest import seed
    from tests.server.admin.test_credentials import bearer, credential

    seed(client)
    for name in ("k1", "k2", "k3"):
        assert client.post(f"{A}/tenants/acme/keys", headers=AUTH, json={"name": name}).status_code == 201
    credential(client, "acme-ops", "tenant-admin", ["acme"])
    ops = bearer(credential(client, "night-ops", "operator")["secret"])
    viewer = bearer(credential(client, "auditor", "viewer")["secret"])
    everything = client.get(f"{A}/audit?limit=500", headers=AUTH).json()["items"]
    kinds = {e["entity_type"] for e in everything}
    assert {"admin_credential", "api_key", "tenant", "pool"} <= kinds
    hidden = {"operator": {"admin_credential", "api_key"}, "viewer": {"admin_credential"}}
    for role, headers in (("operator", ops), ("viewer", viewer)):
        expected = [e["id"] for e in everything if e["entity_type"] not in hidden[role]]
        seen, offset = [], 0
        while True:  # pages of 2: full until the last, in order, nothing skipped
            page = client.get(f"{A}/audit", params={"limit": 2, "offset": offset}, headers=headers).json()
            assert page["total"] == len(expected), role
            assert len(page["items"]) == max(0, min(2, len(expected) - offset)), (role, offset)
            if not page["items"]:
                break
            seen += [e["id"] for e in page["items"]]
            offset += 2
        assert seen == expected, role
        for entity in hidden[role]:  # asking for them by name: an empty page, no error to tell them apart
            asked = client.get(f"{A}/audit", params={"entity_type": entity}, headers=headers).json()
            assert (asked["items"], asked["total"]) == ([], 0), (role, entity)
    assert client.get(f"{A}/audit?entity_type=api_key", headers=viewer).json()["total"] == 3
    assert client.get(f"{A}/audit?entity_type=admin_credential", headers=AUTH).json()["total"] == 3
