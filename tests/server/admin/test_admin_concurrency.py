"""Two concurrent PATCHes of one tenant with the same version over HTTP: one 200, one 409.

Each request runs in its own thread with its own client and database session; a barrier
in ``before_cursor_execute`` releases both ``UPDATE tenants`` statements together, after
both requests have read version 1, so the database's ``WHERE version = ?`` decides.
"""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient
from sqlalchemy import event

from server.app import create_app
from tests.server.admin.conftest import AUTH, seed

A = "/admin/v1"


def test_same_version_concurrent_patches(db, settings, client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    before = client.get(f"{A}/tenants/acme", headers=AUTH).json()
    audit_before = client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"]
    app = create_app(settings, session_factory=db.factory)
    barrier = threading.Barrier(2, timeout=20)

    def hold(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE TENANTS"):
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

    responses: dict[str, tuple[int, dict]] = {}

    def patch(name: str, rpm: int) -> None:
        with TestClient(app) as c:
            r = c.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1, "rpm_limit": rpm, "display_name": name})
            responses[name] = (r.status_code, r.json())

    event.listen(db.engine, "before_cursor_execute", hold)
    try:
        threads = [threading.Thread(target=patch, args=a) for a in (("left", 11), ("right", 22))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        event.remove(db.engine, "before_cursor_execute", hold)

    statuses = sorted(status for status, _ in responses.values())
    assert statuses == [200, 409], responses
    winner = next(n for n, (status, _) in responses.items() if status == 200)
    loser = next(n for n, (status, _) in responses.items() if status == 409)
    assert responses[loser][1]["error"]["code"] == "stale_version"
    after = client.get(f"{A}/tenants/acme", headers=AUTH).json()
    expected = {**before, "display_name": winner, "rpm_limit": 11 if winner == "left" else 22, "version": 2}
    assert {k: v for k, v in after.items() if k != "updated_at"} == {
        k: v for k, v in expected.items() if k != "updated_at"
    }
    assert client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"] == audit_before + 1
