"""The console's bounds: idle sign-out under polling, session caps, sign-in throttle, paging.

Real app over a real registry (as in test_console.py); clocks and caps are shrunk so each
case takes seconds.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from fastapi.testclient import TestClient

from server.admin.console.sessions import SessionStore
from server.app import create_app
from tests.server.admin.conftest import ADMIN_TOKEN, AUTH, OTHER_TOKEN, seed
from tests.server.admin.test_console import CSRF, browser, sign_in, sign_in_as  # noqa: F401

POLL = {"HX-Request": "true"}


def test_polling_does_not_keep_an_idle_session_alive(db, settings) -> None:
    app = create_app(settings, session_factory=db.factory)
    store: SessionStore = app.state.console_app.state.sessions
    now = [0.0]
    store.idle_s, store.clock = 30.0, lambda: now[0]
    with TestClient(app) as c:
        seed(c)
        sign_in(c)
        for t in (10.0, 20.0, 29.0):  # an open page's panel polls on its own
            now[0] = t
            assert c.get("/console/tenants/acme/kv", headers=POLL).status_code == 200
        now[0] = 31.0  # 31 s since the last page the user asked for
        r = c.get("/console/tenants/acme/kv", headers=POLL, follow_redirects=False)
        assert r.status_code == 204 and r.headers["hx-redirect"].startswith("/console/signin")
        assert c.get("/console/tenants", follow_redirects=False).status_code == 303
        assert len(store) == 0
        # A page the user asks for does restart the idle timer.
        sign_in(c)
        now[0] = 60.0
        assert c.get("/console/tenants").status_code == 200
        now[0] = 85.0
        assert c.get("/console/tenants/acme/kv", headers=POLL).status_code == 200


def test_one_credential_cannot_sign_everyone_else_out(db, settings) -> None:
    app = create_app(settings, session_factory=db.factory)
    store: SessionStore = app.state.console_app.state.sessions
    store.max_sessions, store.max_per_credential = 10, 3
    with TestClient(app) as admin, TestClient(app) as other:
        seed(admin)
        sign_in(admin)
        for _ in range(12):
            sign_in_as(other, OTHER_TOKEN)
        assert len(store) == 4  # the admin's session and the other credential's 3 newest
        assert admin.get("/console/tenants", follow_redirects=False).status_code == 200
        assert other.get("/console/tenants", follow_redirects=False).status_code == 200  # its newest lives


def test_the_store_drops_expired_sessions_before_live_ones() -> None:
    now = [0.0]
    store = SessionStore(idle_s=10, max_age_s=20, max_sessions=3, clock=lambda: now[0])
    old, _ = store.create(credential="a", name="a", role="viewer", tenants=None)
    now[0] = 9.0
    assert store.get(old) is not None
    now[0] = 12.0
    live_b, _ = store.create(credential="b", name="b", role="viewer", tenants=None)
    live_c, _ = store.create(credential="c", name="c", role="viewer", tenants=None)
    now[0] = 19.0
    assert store.get(old) is not None  # busy, so the most recently used...
    now[0] = 21.0  # ...but past max_age: it goes first, not b, the least recently used live one
    store.create(credential="d", name="d", role="viewer", tenants=None)
    assert len(store) == 3 and store.get(live_b) is not None and store.get(live_c) is not None
    assert store.get(old) is None
    # Per credential: a third session of b drops b's oldest, nobody else's.
    store.max_per_credential = 2
    second_b, _ = store.create(credential="b", name="b", role="viewer", tenants=None)
    third_b, _ = store.create(credential="b", name="b", role="viewer", tenants=None)
    assert store.get(live_b) is None and store.get(second_b) is not None and store.get(third_b) is not None
    assert store.get(live_c) is not None


def test_failed_sign_ins_are_throttled_per_client(browser: TestClient) -> None:
    def attempt(c: TestClient, token: str):
        page = c.get("/console/signin")
        return c.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": token},
                      follow_redirects=False)

    statuses = [attempt(browser, f"wrong-{i}").status_code for i in range(12)]
    assert statuses[:5] == [401] * 5 and statuses[-1] == 429, statuses
    r = attempt(browser, ADMIN_TOKEN)  # even a good credential waits: nothing is tried meanwhile
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and 'id="signin-error"' in r.text
    app = browser.app
    throttle = app.state.console_app.state.signin_throttle
    throttle.clock = (lambda later: (lambda: later))(throttle.clock() + 3600)  # an hour later: refilled
    assert attempt(browser, ADMIN_TOKEN).status_code == 303
    # Another client is not affected by this one's failures.
    with TestClient(app, client=("10.9.8.7", 4000)) as elsewhere:
        assert attempt(elsewhere, OTHER_TOKEN).status_code == 303


def test_every_tenant_is_reachable_by_paging_or_filter(db, browser: TestClient) -> None:
    from tenants.tenant import create_tenant

    seed(browser)
    with db.factory() as session:
        for i in range(501):
            create_tenant(session, actor="test", now=datetime.now(UTC), slug=f"bulk-{i:04d}", display_name=f"B{i}",
                          pool="gpu-a", retention_class="gold")
        session.commit()
    sign_in(browser)
    rows = lambda text: re.findall(r'<tr data-tenant="([^"]+)"', text)  # noqa: E731
    first = browser.get("/console/tenants").text
    assert rows(first)[0] == "acme" and len(rows(first)) == 50
    assert 'href="/console/tenants?offset=50&amp;limit=50"' in first and "1–50 of 502" in first
    last = browser.get("/console/tenants?offset=500&limit=50").text
    assert rows(last) == ["bulk-0499", "bulk-0500"] and "501–502 of 502" in last
    assert 'href="/console/tenants?offset=450&amp;limit=50"' in last and "offset=550" not in last
    found = browser.get("/console/tenants", params={"q": "bulk-0500"}).text
    assert rows(found) == ["bulk-0500"]
    some = browser.get("/console/tenants", params={"q": "bulk-049", "limit": 4}).text
    assert rows(some) == ["bulk-0490", "bulk-0491", "bulk-0492", "bulk-0493"]
    assert 'href="/console/tenants?offset=4&amp;limit=4&amp;q=bulk-049"' in some
    assert browser.get("/console/tenants?limit=0").status_code == 422
    assert browser.get("/console/tenants?offset=-1").status_code == 422


def test_a_tenants_keys_are_paged(browser: TestClient) -> None:
    seed(browser)
    ids = [browser.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": f"k{i}"}).json()["id"]
           for i in range(3)]
    sign_in(browser)
    keys = lambda text: [int(k) for k in re.findall(r'<tr data-key-id="(\d+)"', text)]  # noqa: E731
    first = browser.get("/console/tenants/acme?limit=2").text
    assert keys(first) == ids[:2] and 'href="/console/tenants/acme?offset=2&amp;limit=2"' in first
    assert keys(browser.get("/console/tenants/acme?offset=2&limit=2").text) == ids[2:]


def test_a_pools_captures_are_paged_newest_first(db, browser: TestClient) -> None:
    """The pool page shows the newest 20 captures with the pager, however many the pool has had, and
    costs the same SQL statements (counted, never timed) with 45 captures as with 75 of more tenants."""
    from sqlalchemy import event

    from tenants import captures
    from tenants.tenant import create_tenant

    seed(browser)

    def cycles(count: int, prefix: str) -> list[int]:
        with db.factory() as s:
            for i in range(count // 3):
                create_tenant(s, actor="t", now=datetime.now(UTC), slug=f"{prefix}{i}", display_name=prefix,
                              pool="gpu-a", retention_class="gold")
            ids = []
            for i in range(count):  # start/stop cycles; a third of them of one tenant each
                tenant = f"{prefix}{i // 3}" if i % 3 == 0 else None
                row = captures.start_capture(s, actor="t", now=datetime.now(UTC), pool="gpu-a", tenant=tenant)
                ids.append(captures.stop_capture(s, actor="t", now=datetime.now(UTC), pool="gpu-a",
                                                 capture_id=row.id).id)
            s.commit()
        return ids

    statements: list[str] = []

    def record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    def pool_page(query: str = "") -> tuple[str, int]:
        statements.clear()
        event.listen(db.engine, "before_cursor_execute", record)
        try:
            r = browser.get(f"/console/pools/gpu-a{query}")
        finally:
            event.remove(db.engine, "before_cursor_execute", record)
        assert r.status_code == 200, r.text[:300]
        return r.text, len(statements)

    rows = lambda text: [int(c) for c in re.findall(r'<tr data-capture="(\d+)"', text)]  # noqa: E731
    ids = cycles(45, "a")
    sign_in(browser)
    first, cost = pool_page()
    assert rows(first) == ids[::-1][:20] and "1–20 of 45" in first
    assert 'href="/console/pools/gpu-a?offset=20&amp;limit=20"' in first and 'rel="prev"' not in first
    last = pool_page("?offset=40&limit=20")[0]
    assert rows(last) == ids[4::-1] and "41–45 of 45" in last
    assert 'href="/console/pools/gpu-a?offset=20&amp;limit=20"' in last and 'rel="next"' not in last
    assert browser.get("/console/pools/gpu-a?limit=0").status_code == 422
    assert browser.get("/console/pools/gpu-a?offset=-1").status_code == 422

    ids += cycles(30, "b")  # thirty more, ten more tenants
    again, cost_again = pool_page()
    assert rows(again) == ids[::-1][:20] and "1–20 of 75" in again
    assert cost_again == cost, (cost, cost_again)  # nothing per capture or per tenant
