"""Admin credentials: roles, tenant scopes, caps, rotation, expiry and revocation, over real HTTP
on a real registry (SQLite, and PostgreSQL when reachable)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from server.app import create_app
from server.serving import build_serving_app
from tests.server.admin.conftest import AUTH, seed


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def add_tenant(client: TestClient, slug: str, **extra: object) -> dict:
    r = client.post("/admin/v1/tenants", headers=AUTH,
                    json={"slug": slug, "display_name": slug.title(), "pool": "gpu-a", "retention_class": "gold",
                          **extra})
    assert r.status_code == 201, r.text
    return r.json()


def credential(client: TestClient, name: str, role: str, tenants: list[str] | None = None, **extra: object) -> dict:
    body: dict[str, object] = {"name": name, "role": role, **extra}
    if tenants is not None:
        body["tenants"] = tenants
    r = client.post("/admin/v1/credentials", headers=AUTH, json=body)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def clock() -> list[datetime]:
    return [datetime(2026, 12, 2, 12, 0, tzinfo=UTC)]


@pytest.fixture
def timed(db, settings, clock):  # type: ignore[no-untyped-def]
    app = create_app(settings, session_factory=db.factory, clock=lambda: clock[0])
    with TestClient(app) as c:
        seed(c)
        yield c


def test_create_whoami_list_and_secret_shown_once(client: TestClient) -> None:
    seed(client)
    created = credential(client, "acme-ops", "tenant-admin", ["acme"])
    assert created["secret"].startswith(f"kva_{created['prefix']}_")
    assert set(created) == {"id", "name", "role", "tenants", "prefix", "secret", "expires_at", "created_at",
                            "last_used_at", "revoked_at"}
    assert created["tenants"] == ["acme"] and created["last_used_at"] is None

    r = client.get("/admin/v1/whoami", headers=bearer(created["secret"]))
    assert r.status_code == 200 and r.json() == {"name": "acme-ops", "role": "tenant-admin", "tenants": ["acme"]}
    assert client.get("/admin/v1/whoami", headers=AUTH).json() == {"name": "admin:ops", "role": "platform-admin",
                                                                   "tenants": None}

    listed = client.get("/admin/v1/credentials", headers=AUTH).json()
    assert listed["total"] == 1 and "secret" not in listed["items"][0]
    one = client.get(f"/admin/v1/credentials/{created['id']}", headers=AUTH).json()
    assert one["last_used_at"] is not None and "secret" not in one
    assert created["secret"] not in client.get("/admin/v1/audit", headers=AUTH).text
    # one tenant named twice (slug and id) is one scope, not a clash blamed on the name
    acme_id = client.get("/admin/v1/tenants/acme", headers=AUTH).json()["id"]
    twice = credential(client, "acme-twice", "viewer", ["acme", str(acme_id), "acme"])
    assert twice["tenants"] == ["acme"]


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "x", "role": "tenant-admin"}, "tenants"),
    ({"name": "x", "role": "operator", "tenants": ["acme"]}, "tenants"),
    ({"name": "x", "role": "platform-admin", "tenants": ["acme"]}, "tenants"),
    ({"name": "x", "role": "viewer", "tenants": ["nope"]}, "tenants"),
    ({"name": "x", "role": "root"}, "role"),
])
def test_create_refuses_bad_scopes(client: TestClient, body: dict, field: str) -> None:
    seed(client)
    r = client.post("/admin/v1/credentials", headers=AUTH, json=body)
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text


def test_tenant_admin_sees_only_its_tenants_and_cannot_tell_foreign_from_missing(client: TestClient) -> None:
    seed(client)
    for slug in ("globex", "initech", "umbrella"):
        add_tenant(client, slug)
    secret = credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"]
    me = bearer(secret)

    page = client.get("/admin/v1/tenants?limit=1&offset=0", headers=me).json()
    assert [t["slug"] for t in page["items"]] == ["acme"] and page["total"] == 1
    assert client.get("/admin/v1/tenants?offset=1", headers=me).json() == {
        "items": [], "total": 1, "limit": 50, "offset": 1}
    # pools are not its to list: filtering by a pool it cannot see or one that does not exist reads the same
    r = client.post("/admin/v1/pools", headers=AUTH, json={
        "name": "secret-pool", "model_name": "m", "triton_url": "127.0.0.1:8001", "primary_blocks": 64})
    assert r.status_code == 201, r.text
    secret_id = r.json()["id"]
    assert client.get("/admin/v1/pools", headers=me).status_code == 403
    empty = {"items": [], "total": 0, "limit": 50, "offset": 0}
    for ref in ("secret-pool", "no-such-pool", str(secret_id), str(secret_id + 1000)):
        assert client.get("/admin/v1/tenants", params={"pool": ref}, headers=me).json() == empty, ref
    assert client.get("/admin/v1/tenants", params={"pool": "gpu-a"}, headers=me).json()["total"] == 1
    assert client.get("/admin/v1/tenants", params={"pool": "no-such-pool"}, headers=AUTH).status_code == 422

    globex_id = client.get("/admin/v1/tenants/globex", headers=AUTH).json()["id"]
    foreign = {path: client.request(method, path, headers=me, json=body) for method, path, body in (
        ("GET", "/admin/v1/tenants/globex", None),
        ("GET", f"/admin/v1/tenants/{globex_id}", None),
        ("PATCH", "/admin/v1/tenants/globex", {"version": 1, "rpm_limit": 1}),
        ("GET", "/admin/v1/tenants/globex/keys", None),
        ("POST", "/admin/v1/tenants/globex/keys", {"name": "x"}),
        ("GET", "/admin/v1/tenants/globex/usage", None),
        ("GET", "/admin/v1/tenants/globex/retention", None),
        ("GET", "/admin/v1/tenants/globex/captures", None),
    )}
    assert client.delete("/admin/v1/tenants/globex", headers=AUTH).status_code == 204
    for path, answer in foreign.items():
        method = "PATCH" if answer.request.method == "PATCH" else answer.request.method
        body = {"version": 1, "rpm_limit": 1} if method == "PATCH" else {"name": "x"} if method == "POST" else None
        missing = client.request(method, path, headers=AUTH, json=body)  # as the platform admin sees a missing one
        assert answer.status_code == missing.status_code == 404, (path, answer.text)
        assert answer.json() == missing.json(), path
    assert client.get("/admin/v1/tenants/ghost", headers=me).json() == {"error": {
        "code": "tenant_not_found", "message": "tenant 'ghost' does not exist", "field": None}}


def test_tenant_admin_manages_its_keys_and_nothing_else(client: TestClient) -> None:
    seed(client)
    mine = credential(client, "acme-ops", "tenant-admin", ["acme"])
    me = bearer(mine["secret"])
    key = client.post("/admin/v1/tenants/acme/keys", headers=me, json={"name": "ci"})
    assert key.status_code == 201 and key.json()["key"].startswith("kvg_")
    assert client.get("/admin/v1/tenants/acme/keys", headers=me).json()["total"] == 1
    assert client.post(f"/admin/v1/tenants/acme/keys/{key.json()['id']}/revoke", headers=me).status_code == 200

    for role in ("platform-admin", "operator", "viewer", "tenant-admin"):
        body = {"name": f"mine-{role}", "role": role, **({"tenants": ["acme"]} if role == "tenant-admin" else {})}
        r = client.post("/admin/v1/credentials", headers=me, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert client.get("/admin/v1/credentials", headers=me).status_code == 403
    assert client.get("/admin/v1/pools", headers=me).status_code == 403
    assert client.get("/admin/v1/audit", headers=me).status_code == 403
    assert client.post("/admin/v1/tenants/acme/suspend", headers=me).status_code == 403
    events = client.get("/admin/v1/audit?entity_type=api_key", headers=AUTH).json()["items"]
    assert {e["actor"] for e in events} == {f"cred:{mine['id']}:acme-ops"}


def test_tenant_admin_limits_stay_within_caps(client: TestClient) -> None:
    seed(client)
    me = bearer(credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"])

    def patch(headers: dict, **changes: object):  # type: ignore[no-untyped-def]
        version = client.get("/admin/v1/tenants/acme", headers=AUTH).json()["version"]
        return client.patch("/admin/v1/tenants/acme", headers=headers, json={"version": version, **changes})

    r = patch(me, rpm_limit=100)
    assert r.status_code == 403 and r.json()["error"]["code"] == "limit_not_capped", r.text
    r = patch(AUTH, limit_caps={"rpm_limit": 1000, "kv_quota_fraction": 0.6})
    assert r.status_code == 200 and r.json()["limit_caps"] == {"rpm_limit": 1000, "kv_quota_fraction": 0.6}
    assert patch(me, rpm_limit=1000).json()["rpm_limit"] == 1000
    r = patch(me, rpm_limit=1001)
    assert r.status_code == 403 and r.json()["error"] == {
        "code": "limit_above_cap", "message": "rpm_limit 1001 is above its cap 1000", "field": "rpm_limit"}
    assert patch(me, kv_quota_fraction=0.7).status_code == 403
    for change in ({"limit_caps": {"rpm_limit": 10**6}}, {"pool": "gpu-a"}, {"isolation": "shared"},
                   {"display_name": "Mine"}):
        r = patch(me, **change)
        assert r.status_code == 403 and r.json()["error"]["code"] == "field_not_permitted", (change, r.text)
    assert client.get("/admin/v1/tenants/acme", headers=AUTH).json()["limit_caps"]["rpm_limit"] == 1000


def test_operator_and_viewer(client: TestClient) -> None:
    seed(client)
    add_tenant(client, "globex")
    ops = bearer(credential(client, "night-ops", "operator")["secret"])
    assert client.get("/admin/v1/tenants/acme/keys", headers=ops).status_code == 403
    assert client.post("/admin/v1/tenants/acme/keys", headers=ops, json={}).status_code == 403
    assert client.post("/admin/v1/tenants", headers=ops, json={}).status_code == 403
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=ops, json={"ttft_p99_ms": 500})
    assert r.status_code == 200, r.text
    assert client.get("/admin/v1/tenants", headers=ops).json()["total"] == 2

    viewer = bearer(credential(client, "auditor", "viewer")["secret"])
    assert client.get("/admin/v1/audit", headers=viewer).status_code == 200
    assert client.get("/admin/v1/tenants/globex", headers=viewer).status_code == 200
    assert client.put("/admin/v1/pools/gpu-a/slo", headers=viewer, json={}).status_code == 403
    scoped = bearer(credential(client, "acme-viewer", "viewer", ["acme"])["secret"])
    assert client.get("/admin/v1/tenants", headers=scoped).json()["total"] == 1
    assert client.get("/admin/v1/tenants/globex", headers=scoped).status_code == 404
    assert client.get("/admin/v1/tenants/acme/usage", headers=scoped).status_code == 200
    assert client.get("/admin/v1/pools", headers=scoped).status_code == 403
    assert client.post("/admin/v1/tenants/acme/keys", headers=scoped, json={}).status_code == 403


def test_rotation_overlap_then_refused(timed: TestClient, clock: list[datetime]) -> None:
    created = credential(timed, "rotor", "viewer")
    old = bearer(created["secret"])
    r = timed.post(f"/admin/v1/credentials/{created['id']}/rotate", headers=AUTH, json={"overlap_seconds": 60})
    assert r.status_code == 201, r.text
    new = bearer(r.json()["secret"])
    assert r.json()["prefix"] == created["prefix"] and r.json()["secret"] != created["secret"]
    clock[0] += timedelta(seconds=59)
    assert timed.get("/admin/v1/whoami", headers=old).status_code == 200
    assert timed.get("/admin/v1/whoami", headers=new).status_code == 200
    clock[0] += timedelta(seconds=1)
    assert timed.get("/admin/v1/whoami", headers=old).status_code == 401
    assert timed.get("/admin/v1/whoami", headers=new).status_code == 200
    r = timed.post(f"/admin/v1/credentials/{created['id']}/rotate", headers=AUTH, json={"overlap_seconds": 0})
    assert timed.get("/admin/v1/whoami", headers=new).status_code == 401
    actions = [e["action"] for e in timed.get("/admin/v1/audit?entity_type=admin_credential", headers=AUTH).json()["items"]]
    assert actions == ["admin_credential.rotate", "admin_credential.rotate", "admin_credential.create"]


def test_expiry_is_refused_at_once(timed: TestClient, clock: list[datetime]) -> None:
    expires = clock[0] + timedelta(minutes=5)
    secret = credential(timed, "temp", "operator", expires_at=expires.isoformat())["secret"]
    clock[0] = expires - timedelta(microseconds=1)
    assert timed.get("/admin/v1/whoami", headers=bearer(secret)).status_code == 200
    clock[0] = expires
    r = timed.get("/admin/v1/whoami", headers=bearer(secret))
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_revocation_holds_at_once_on_two_gateways_sharing_a_registry(db, settings) -> None:  # type: ignore[no-untyped-def]
    apps = [build_serving_app(settings, session_factory=db.factory, registry=CollectorRegistry()) for _ in range(2)]
    with TestClient(apps[0]) as a, TestClient(apps[1]) as b:
        seed(a)
        created = credential(a, "acme-ops", "tenant-admin", ["acme"])
        me = bearer(created["secret"])
        for gateway in (a, b):  # both answer and keep answering
            assert gateway.get("/admin/v1/tenants/acme/keys", headers=me).status_code == 200
        assert a.delete(f"/admin/v1/credentials/{created['id']}", headers=AUTH).status_code == 204
        for gateway in (b, a):
            r = gateway.get("/admin/v1/tenants/acme/keys", headers=me)
            assert r.status_code == 401, r.text
        assert b.delete(f"/admin/v1/credentials/{created['id']}", headers=AUTH).status_code == 204  # idempotent
        # Expiry: these gateways read the wall clock, so the credential expires in a few seconds.
        expires = datetime.now(UTC) + timedelta(seconds=4)
        brief = bearer(credential(b, "brief", "viewer", expires_at=expires.isoformat())["secret"])
        if datetime.now(UTC) < expires - timedelta(seconds=1):  # both answered before the expiry
            assert [g.get("/admin/v1/whoami", headers=brief).status_code for g in (a, b)] == [200, 200]
        time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.05)
        assert [g.get("/admin/v1/whoami", headers=brief).status_code for g in (a, b)] == [401, 401]
        r = b.post(f"/admin/v1/credentials/{created['id']}/rotate", headers=AUTH, json={"overlap_seconds": 0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "credential_revoked"


def test_unknown_and_malformed_credentials_are_401(client: TestClient) -> None:
    seed(client)
    secret = credential(client, "v", "viewer")["secret"]
    prefix = secret.split("_")[1]
    for presented in (f"kva_{prefix}_{'A' * 43}", "kva_zzzzzzzz_" + "B" * 43, "kva_", secret[:-1], secret + "x"):
        r = client.get("/admin/v1/whoami", headers=bearer(presented))
        assert r.status_code == 401, presented


def test_missing_and_foreign_tenants_take_the_same_queries(db, client: TestClient) -> None:  # type: ignore[no-untyped-def]
    """No timing oracle: for a scoped caller a foreign tenant and a missing one run the very
    same SQL statements (counted, not timed) and get bodies that differ only by the name asked."""
    from sqlalchemy import event

    seed(client)
    add_tenant(client, "globex")
    me = bearer(credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"])
    statements: list[str] = []

    def record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        runs = {}
        for ref in ("globex", "ghostx"):  # same length: the parameters differ only in the name
            for path in (f"/admin/v1/tenants/{ref}", f"/admin/v1/tenants/{ref}/keys"):
                statements.clear()
                client.get("/admin/v1/whoami", headers=me)  # settles last_used_at, so both runs skip its write
                statements.clear()
                r = client.get(path, headers=me)
                runs[(ref, path.replace(ref, "*"))] = (r.status_code, r.json(), list(statements))
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    for path in ("/admin/v1/tenants/*", "/admin/v1/tenants/*/keys"):
        foreign, missing = runs[("globex", path)], runs[("ghostx", path)]
        assert foreign[0] == missing[0] == 404
        assert foreign[1]["error"]["message"].replace("globex", "ghostx") == missing[1]["error"]["message"]
        assert foreign[2] == missing[2] and foreign[2], path


def test_tenant_admin_reads_its_kv_figures_from_the_gateway(db, settings, client: TestClient) -> None:  # type: ignore[no-untyped-def]
    """What the gateway process knows of the tenant's KV: the pool monitor's latest poll (fed a
    report through its own ``apply``) and the per-request counters; a bare admin app has none."""
    from engines.contract import KvMetrics
    from engines.pool_stats import PoolStatsReport, TierStats
    from server.gateway.replicas.pool_monitor import TenantQuota
    from tenants.auth import list_pool_snapshots

    seed(client)
    add_tenant(client, "globex")
    secret = credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"]
    r = client.get("/admin/v1/tenants/acme/kv", headers=bearer(secret))
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_gateway"

    app = build_serving_app(settings, session_factory=db.factory, registry=CollectorRegistry())
    with TestClient(app) as gateway:
        me = bearer(secret)
        r = gateway.get("/admin/v1/tenants/acme/kv", headers=me)
        assert r.status_code == 200 and r.json()["polled"] is False and r.json()["hit_rate"] is None
        services = app.state.gateway
        acme, globex = (gateway.get(f"/admin/v1/tenants/{s}", headers=AUTH).json()["id"] for s in ("acme", "globex"))
        with db.factory() as s:
            pool = list_pool_snapshots(s)[0]
        report = PoolStatsReport(tokens_per_block=32, primary=TierStats(128, 28, 100), secondary=TierStats(256, 200, 56),
                                 cache_hit_rate=0.4, tenants={str(acme): [70, 6], str(globex): [30, 50]})
        services.monitor.apply(pool, report, [TenantQuota(acme, "acme", 0.5), TenantQuota(globex, "globex", 0.5)])
        for slug, tid, reused, new in (("acme", acme, 3, 1), ("globex", globex, 0, 9)):
            services.metrics.observe_request(tenant=slug, pool="gpu-a", status="ok", prompt_tokens=10,
                                             completion_tokens=1, ttft=0.1, latency=0.2,
                                             kv=KvMetrics(reused_blocks=reused, new_blocks=new), demoted=False,
                                             tenant_id=tid)
        figures = gateway.get("/admin/v1/tenants/acme/kv", headers=me).json()
        shown = {k: figures[k] for k in ("tenant", "pool", "polled", "primary_blocks", "secondary_blocks", "demoted",
                                         "pool_hit_rate", "reused_blocks", "new_blocks", "hit_rate")}
        assert shown == {"tenant": "acme", "pool": "gpu-a", "polled": True, "primary_blocks": 70,
                         "secondary_blocks": 6, "demoted": True, "pool_hit_rate": 0.4, "reused_blocks": 3,
                         "new_blocks": 1, "hit_rate": 0.75}
        assert gateway.get("/admin/v1/tenants/globex/kv", headers=me).status_code == 404


@pytest.mark.parametrize("body", [
    {"name": "x", "role": "viewer", "expires_at": "9999-12-31T23:59:59-05:00"},
    {"name": "x", "role": "viewer", "expires_at": "2020-01-01T00:00:00Z"},
    {"name": "x", "role": "viewer", "expires_at": "2030-01-01T00:00:00"},
    {"name": "x\u0000y", "role": "viewer"},
    {"name": "   ", "role": "viewer"},
    {"name": "x", "role": "viewer", "tenants": []},
    {"name": "x", "role": "viewer", "tenants": ["acme", "acme"], "extra": 1},
    {"name": "x" * 129, "role": "viewer"},
])
def test_bad_credential_bodies_are_4xx(client: TestClient, body: dict) -> None:
    seed(client)
    r = client.post("/admin/v1/credentials", headers=AUTH, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"code", "message", "field"}


def test_bad_rotations_are_4xx(client: TestClient) -> None:
    seed(client)
    cid = credential(client, "v", "viewer")["id"]
    for body in ({"overlap_seconds": -1}, {"overlap_seconds": 10**12}, {"overlap_seconds": "60"}, {}):
        r = client.post(f"/admin/v1/credentials/{cid}/rotate", headers=AUTH, json=body)
        assert r.status_code == 422, (body, r.text)
    for path in ("/admin/v1/credentials/0", "/admin/v1/credentials/99999", "/admin/v1/credentials/abc"):
        assert client.get(path, headers=AUTH).status_code in (404, 422)
    assert client.delete("/admin/v1/credentials/99999", headers=AUTH).status_code == 404
    dup = client.post("/admin/v1/credentials", headers=AUTH, json={"name": "v", "role": "viewer"})
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "duplicate"


def test_an_expiry_utc_cannot_hold_is_422_for_keys_too(client: TestClient) -> None:
    """Year 9999 at a negative offset is past UTC's range: refused, not a 500 (was an OverflowError)."""
    seed(client)
    r = client.post("/admin/v1/tenants/acme/keys", headers=AUTH,
                    json={"name": "k", "expires_at": "9999-12-31T23:59:59-05:00"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "expires_at", r.text


def test_rotate_and_revoke_events_carry_the_credentials_scope(client: TestClient) -> None:
    seed(client)
    add_tenant(client, "globex")
    scoped = credential(client, "acme-ops", "tenant-admin", ["globex", "acme"])
    plain = credential(client, "night-ops", "operator")
    for cred in (scoped, plain):
        assert client.post(f"/admin/v1/credentials/{cred['id']}/rotate", headers=AUTH,
                           json={"overlap_seconds": 0}).status_code == 201
        assert client.delete(f"/admin/v1/credentials/{cred['id']}", headers=AUTH).status_code == 204
    for cred, scope in ((scoped, ["acme", "globex"]), (plain, None)):
        events = client.get("/admin/v1/audit", params={"entity_type": "admin_credential", "entity_id": cred["id"]},
                            headers=AUTH).json()["items"]
        assert [e["action"] for e in events] == ["admin_credential.revoke", "admin_credential.rotate",
                                                 "admin_credential.create"]
        assert [(e["before"] or {}).get("tenants", "-") for e in events] == [scope, scope, "-"]
        assert [e["after"]["tenants"] for e in events] == [scope, scope, scope]


def test_long_names_never_share_an_audit_actor(client: TestClient) -> None:
    """The actor is ``cred:<id>:<name>`` cut to 128 chars: two names alike in their first 123
    chars (once the same actor, ``cred:<name>``[:128]) stay told apart by the id."""
    seed(client)
    alice = credential(client, "x" * 123 + "al", "tenant-admin", ["acme"])
    mallory = credential(client, "x" * 123 + "ma", "tenant-admin", ["acme"])
    for cred, key in ((alice, "by-alice"), (mallory, "by-mallory")):
        assert client.post("/admin/v1/tenants/acme/keys", headers=bearer(cred["secret"]),
                           json={"name": key}).status_code == 201
    events = client.get("/admin/v1/audit?entity_type=api_key", headers=AUTH).json()["items"]
    actors = {e["after"]["name"]: e["actor"] for e in events}
    assert actors["by-alice"] != actors["by-mallory"]
    assert actors["by-alice"] == f"cred:{alice['id']}:{alice['name']}"[:128]
    assert len(actors["by-alice"]) == 128
    mine = client.get("/admin/v1/audit", params={"actor": actors["by-mallory"]}, headers=AUTH).json()
    assert [e["after"]["name"] for e in mine["items"]] == ["by-mallory"]


@pytest.mark.parametrize("name", ["acme\u202eops", "\u2066acme\u2069", "acme\u200bops", "acme\x1b[31m",
                                  "acme\nops", "acme\x7f", "acme\u2028ops", "\ufeffacme"])
def test_credential_names_with_control_or_format_characters_are_422(client: TestClient, name: str) -> None:
    seed(client)
    r = client.post("/admin/v1/credentials", headers=AUTH, json={"name": name, "role": "viewer"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "name", r.text
    assert "control or formatting" in r.json()["error"]["message"]
    assert client.get("/admin/v1/credentials", headers=AUTH).json()["total"] == 0
    # what stays allowed: any printable name, accents, other scripts, spaces
    assert credential(client, "Équipe nuit — 夜勤 ops", "viewer")["name"] == "Équipe nuit — 夜勤 ops"
