"""GET /admin/v1/tenants/{ref}/usage: totals and per-minute rows over an optional window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tenants import UsageRow, record_usage
from tests.server.admin.conftest import AUTH, seed

A = "/admin/v1"
# After the tenants' creation: a row of a minute before its tenant was created is dropped.
T0 = (datetime.now(UTC) + timedelta(days=1)).replace(second=0, microsecond=0)
NO_CACHE = {"cache_read_tokens": 0, "cache_write_5m_tokens": 0, "cache_write_1h_tokens": 0}


def test_usage_report(db, client) -> None:  # type: ignore[no-untyped-def]
    tenant = seed(client)
    with db.factory() as s:
        rows = [
            UsageRow(tenant["id"], T0 + timedelta(minutes=m), requests=1, prompt_tokens=10 * m, completion_tokens=m,
                     cache_read_tokens=4 * m, cache_write_5m_tokens=2 * m, cache_write_1h_tokens=m)
            for m in range(5)
        ]
        assert record_usage(s, flush_id="batch-1", rows=rows)
        assert not record_usage(s, flush_id="batch-1", rows=rows)
    body = client.get(f"{A}/tenants/acme/usage", headers=AUTH).json()
    assert body["total"] == {"requests": 5, "prompt_tokens": 100, "completion_tokens": 10, "cache_read_tokens": 40,
                             "cache_write_5m_tokens": 20, "cache_write_1h_tokens": 10}
    assert body["total_minutes"] == 5 and len(body["items"]) == 5
    assert {k: v for k, v in body["items"][3].items() if k != "minute"} == {
        "requests": 1, "prompt_tokens": 30, "completion_tokens": 3, "cache_read_tokens": 12,
        "cache_write_5m_tokens": 6, "cache_write_1h_tokens": 3}
    window = client.get(
        f"{A}/tenants/acme/usage",
        headers=AUTH,
        params={
            "from": (T0 + timedelta(minutes=1)).isoformat(),
            "to": (T0 + timedelta(minutes=3)).isoformat(),
            "limit": 1,
        },
    ).json()
    assert window["total"] == {"requests": 2, "prompt_tokens": 30, "completion_tokens": 3, "cache_read_tokens": 12,
                               "cache_write_5m_tokens": 6, "cache_write_1h_tokens": 3}
    assert window["total_minutes"] == 2 and [i["prompt_tokens"] for i in window["items"]] == [10]
    assert [i["cache_read_tokens"] for i in window["items"]] == [4]
    r = client.get(f"{A}/tenants/acme/usage", headers=AUTH, params={"from": "2026-03-01T12:00:00"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "from"
    r = client.get(f"{A}/tenants/ghost/usage", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"


def _total(client, **window) -> dict:  # type: ignore[no-untyped-def]
    r = client.get(f"{A}/tenants/acme/usage", headers=AUTH, params={k: v.isoformat() for k, v in window.items()})
    assert r.status_code == 200, r.text
    return r.json()["total"]


def test_adjacent_windows_cut_inside_a_minute_never_share_it(db, client) -> None:  # type: ignore[no-untyped-def]
    tenant = seed(client)
    with db.factory() as s:
        record_usage(s, flush_id="b1", rows=[UsageRow(tenant["id"], T0 + timedelta(seconds=10), 1, 100, 10),
                                             UsageRow(tenant["id"], T0 + timedelta(seconds=50), 1, 100, 10)])
    before, after, cut = T0 - timedelta(hours=1), T0 + timedelta(hours=1), T0 + timedelta(seconds=30)
    whole = _total(client, **{"from": before, "to": after})
    assert whole == {"requests": 2, "prompt_tokens": 200, "completion_tokens": 20, **NO_CACHE}
    first, second = _total(client, **{"from": before, "to": cut}), _total(client, **{"from": cut, "to": after})
    assert {k: first[k] + second[k] for k in whole} == whole  # billed once, not in both halves
    assert first == whole  # the minute is in [from, to) iff its start (T0) is
    assert _total(client, **{"from": cut, "to": cut})["requests"] == 0  # [x, x) is empty
    # the API says how bounds round
    spec = client.get(f"{A}/openapi.json").json()["paths"]["/tenants/{ref}/usage"]["get"]
    params = {p["name"]: p for p in spec["parameters"]}
    assert "half-open on minute buckets" in spec["description"]
    assert "rounds up to the next minute start" in params["from"]["description"]
    assert "rounds up to the next minute start" in params["to"]["description"]
    # and what the cache counters count
    totals = client.get(f"{A}/openapi.json").json()["components"]["schemas"]["UsageTotalsPublic"]["properties"]
    assert "served from the KV cache" in totals["cache_read_tokens"]["description"]
    assert "ephemeral_1h_input_tokens" in totals["cache_write_1h_tokens"]["description"]


def test_console_usage_is_the_last_24_h_from_a_minute_start_with_exact_counts(db, client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from server.admin.console import tenant_pages
    from tests.server.admin.test_console import sign_in

    tenant = seed(client)
    big = 2**53 + 1  # 9007199254740993: a float would show 9,007,199,254,740,992
    with db.factory() as s:  # the minute 24 h before "now" and the one after it
        record_usage(s, flush_id="b1", rows=[UsageRow(tenant["id"], T0, 1, big, 1, 1200, 300, 50),
                                             UsageRow(tenant["id"], T0 + timedelta(minutes=1), 1, 0, 1, 34)])

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
            return T0 + timedelta(days=1, seconds=30)  # mid-minute: 24 h before is T0 + 30 s

    monkeypatch.setattr(tenant_pages, "datetime", Clock)
    sign_in(client)
    page = client.get("/console/tenants/acme")
    assert page.status_code == 200, page.text
    usage = page.text[page.text.index('id="usage"'):]
    assert "<dt>Requests</dt><dd>2</dd>" in usage  # T0's minute is within the last 24 h
    assert f"<dd>{big:,}</dd>" in usage and "9,007,199,254,740,993" in usage
    assert "<dd>1,234 / 300 / 50</dd>" in usage  # of the prompt: read from cache / kept 5 m / kept 1 h
