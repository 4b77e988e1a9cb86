"""GET /admin/v1/tenants/{ref}/usage: totals and per-minute rows over an optional window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tenants import UsageRow, record_usage
from tests.server.admin.conftest import AUTH, seed

A = "/admin/v1"
# After the tenants' creation: a row of a minute before its tenant was created is dropped.
T0 = (datetime.now(UTC) + timedelta(days=1)).replace(second=0, microsecond=0)


def test_usage_report(db, client) -> None:  # type: ignore[no-untyped-def]
    tenant = seed(client)
    with db.factory() as s:
        rows = [
            UsageRow(tenant["id"], T0 + timedelta(minutes=m), requests=1, prompt_tokens=10 * m, completion_tokens=m)
            for m in range(5)
        ]
        assert record_usage(s, flush_id="batch-1", rows=rows)
        assert not record_usage(s, flush_id="batch-1", rows=rows)
    body = client.get(f"{A}/tenants/acme/usage", headers=AUTH).json()
    assert body["total"] == {"requests": 5, "prompt_tokens": 100, "completion_tokens": 10}
    assert body["total_minutes"] == 5 and len(body["items"]) == 5
    window = client.get(
        f"{A}/tenants/acme/usage",
        headers=AUTH,
        params={
            "from": (T0 + timedelta(minutes=1)).isoformat(),
            "to": (T0 + timedelta(minutes=3)).isoformat(),
            "limit": 1,
        },
    ).json()
    assert window["total"] == {"requests": 2, "prompt_tokens": 30, "completion_tokens": 3}
    assert window["total_minutes"] == 2 and [i["prompt_tokens"] for i in window["items"]] == [10]
    r = client.get(f"{A}/tenants/acme/usage", headers=AUTH, params={"from": "2026-03-01T12:00:00"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "from"
    r = client.get(f"{A}/tenants/ghost/usage", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
