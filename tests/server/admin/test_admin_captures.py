"""Live trace captures through the admin REST API (real HTTP, real registry on both backends)."""

from __future__ import annotations

from sqlalchemy import select

from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_admin_crud import _error

A = "/admin/v1"


def test_capture_lifecycle_audit_and_secrecy(client, db) -> None:  # type: ignore[no-untyped-def]
    from tenants.captures import active_captures
    from tenants.models import TraceCapture

    seed(client)
    r = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"sample_rate": 0.25, "max_bytes": 1_000_000,
                                                                   "tenant": "acme"})
    assert r.status_code == 201, r.text
    cap = r.json()
    assert (cap["pool"], cap["tenant"], cap["sample_rate"], cap["max_bytes"], cap["state"], cap["stopped_at"]) == (
        "gpu-a", "acme", 0.25, 1_000_000, "active", None)
    assert "key" not in cap
    # one active capture per pool
    _error(client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={}), 409, "capture_active", "pool")
    assert client.get(f"{A}/pools/gpu-a/captures/{cap['id']}", headers=AUTH).json() == cap
    assert [c["id"] for c in client.get(f"{A}/pools/gpu-a/captures", headers=AUTH).json()["items"]] == [cap["id"]]

    with db.factory() as s:
        (active,) = active_captures(s)
        row = s.scalars(select(TraceCapture)).one()
        assert active.pool == "gpu-a" and active.key == bytes.fromhex(row.key) and len(active.key) == 32

    stopped = client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH)
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped" and stopped.json()["stopped_at"]
    assert client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH).json()["version"] == \
        stopped.json()["version"]  # a no-op: no second event
    with db.factory() as s:
        assert active_captures(s) == []
    # a new one may start once the old one stopped (default rate and size)
    again = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={})
    assert again.status_code == 201 and (again.json()["sample_rate"], again.json()["tenant"]) == (1.0, None)

    events = client.get(f"{A}/audit?entity_type=trace_capture", headers=AUTH).json()["items"]
    assert [e["action"] for e in events] == ["trace_capture.create", "trace_capture.stop", "trace_capture.create"]
    assert all("key" not in (e["before"] or {}) and "key" not in (e["after"] or {}) for e in events)


def test_capture_errors(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    client.post(f"{A}/pools", headers=AUTH, json={"name": "gpu-b", "model_name": "m", "triton_url": "h:1",
                                                  "primary_blocks": 8})
    _error(client.post(f"{A}/pools/nope/captures", headers=AUTH, json={}), 404, "pool_not_found")
    for body, field in (({"sample_rate": 0}, "sample_rate"), ({"sample_rate": 1.5}, "sample_rate"),
                        ({"max_bytes": 0}, "max_bytes"), ({"max_bytes": "1"}, "max_bytes"), ({"key": "x"}, "key")):
        r = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json=body)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, (body, r.text)
    _error(client.post(f"{A}/pools/gpu-b/captures", headers=AUTH, json={"tenant": "acme"}), 422,
           "tenant_not_on_pool", "tenant")
    _error(client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": "ghost"}), 422,
           "unknown_tenant", "tenant")
    _error(client.get(f"{A}/pools/gpu-a/captures/99", headers=AUTH), 404, "capture_not_found")
    _error(client.post(f"{A}/pools/gpu-a/captures/x/stop", headers=AUTH), 404, "capture_not_found")
    assert client.post(f"{A}/pools/gpu-a/captures", json={}).status_code == 401
    # a pool's captures go with the pool
    assert client.post(f"{A}/pools/gpu-b/captures", headers=AUTH, json={}).status_code == 201
    assert client.delete(f"{A}/pools/gpu-b", headers=AUTH).status_code == 204


def _statements(db, call):  # type: ignore[no-untyped-def]
    """The SQL statements ``call()`` runs (counted, never timed) and its result."""
    from sqlalchemy import event

    seen: list[str] = []

    def record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        result = call()
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    return seen, result


def test_captures_are_paged_newest_first_in_constant_queries(client, db) -> None:  # type: ignore[no-untyped-def]
    """The list pages as the admin API's other lists do ({items, total, limit, offset}, limit 1..500,
    offset >= 0, 422 naming the parameter otherwise), newest first, and costs the same statements
    however many captures (and of how many tenants) the pool has had."""
    seed(client)

    def cycle(tenant: str | None) -> int:
        cap = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": tenant} if tenant else {}).json()
        assert client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH).status_code == 200
        return cap["id"]

    def add_tenants(names: list[str]) -> None:
        for name in names:
            r = client.post(f"{A}/tenants", headers=AUTH,
                            json={"slug": name, "display_name": name, "pool": "gpu-a", "retention_class": "gold"})
            assert r.status_code == 201, r.text

    add_tenants([f"t{i}" for i in range(5)])
    ids = [cycle(f"t{i % 5}" if i % 3 else None) for i in range(7)]
    page = client.get(f"{A}/pools/gpu-a/captures?limit=3&offset=1", headers=AUTH).json()
    assert set(page) == {"items", "total", "limit", "offset"}
    assert ([c["id"] for c in page["items"]], page["total"], page["limit"], page["offset"]) == (
        ids[::-1][1:4], 7, 3, 1)
    assert [c["tenant"] for c in page["items"]] == [f"t{i % 5}" if i % 3 else None for i in (5, 4, 3)]
    assert all(c["pool"] == "gpu-a" and c["state"] == "stopped" and "key" not in c for c in page["items"])
    whole = client.get(f"{A}/pools/gpu-a/captures", headers=AUTH).json()
    assert ([c["id"] for c in whole["items"]], whole["limit"], whole["offset"]) == (ids[::-1], 50, 0)
    assert whole["items"][0] == client.get(f"{A}/pools/gpu-a/captures/{ids[-1]}", headers=AUTH).json()
    for query, field in (("limit=0", "limit"), ("limit=501", "limit"), ("offset=-1", "offset"), ("limit=x", "limit"),
                         ("offset=2147483648", "offset")):
        _error(client.get(f"{A}/pools/gpu-a/captures?{query}", headers=AUTH), 422, field=field)
    assert client.get(f"{A}/pools/gpu-a/captures?limit=500", headers=AUTH).status_code == 200
    assert client.get(f"{A}/pools/gpu-a/captures?offset=70", headers=AUTH).json()["items"] == []
    _error(client.get(f"{A}/pools/nope/captures", headers=AUTH), 404, "pool_not_found")

    few, _ = _statements(db, lambda: client.get(f"{A}/pools/gpu-a/captures", headers=AUTH))
    add_tenants([f"u{i}" for i in range(20)])
    more = [cycle(f"u{i}") for i in range(20)]  # twenty more rows, each of another tenant
    many, r = _statements(db, lambda: client.get(f"{A}/pools/gpu-a/captures", headers=AUTH))
    assert [c["id"] for c in r.json()["items"]][:20] == more[::-1] and r.json()["total"] == 27
    assert len(many) == len(few), (few, many)  # no lookup per row or per tenant


def test_a_tenants_captures_are_paged_newest_first_in_constant_queries(client, db) -> None:  # type: ignore[no-untyped-def]
    """``/tenants/{ref}/captures`` pages as the pool's list does: only that tenant's captures."""
    seed(client)

    def cycle(tenant: str | None) -> int:
        cap = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": tenant} if tenant else {}).json()
        assert client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH).status_code == 200
        return cap["id"]

    ids = [cycle("acme" if i % 2 else None) for i in range(6)]
    mine = [i for n, i in enumerate(ids) if n % 2]
    page = client.get(f"{A}/tenants/acme/captures?limit=2&offset=1", headers=AUTH).json()
    assert set(page) == {"items", "total", "limit", "offset"}
    assert ([c["id"] for c in page["items"]], page["total"], page["limit"], page["offset"]) == (
        mine[::-1][1:3], 3, 2, 1)
    assert all(c["tenant"] == "acme" and c["pool"] == "gpu-a" and "key" not in c for c in page["items"])
    for query, field in (("limit=0", "limit"), ("limit=501", "limit"), ("offset=-1", "offset")):
        _error(client.get(f"{A}/tenants/acme/captures?{query}", headers=AUTH), 422, field=field)
    few, _ = _statements(db, lambda: client.get(f"{A}/tenants/acme/captures", headers=AUTH))
    more = [cycle("acme") for _ in range(10)]
    many, r = _statements(db, lambda: client.get(f"{A}/tenants/acme/captures", headers=AUTH))
    assert [c["id"] for c in r.json()["items"]][:10] == more[::-1] and r.json()["total"] == 13
    assert len(many) == len(few), (few, many)  # no lookup per row
