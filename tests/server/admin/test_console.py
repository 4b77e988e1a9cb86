"""The web console's security and flows over real HTTP to a real app (no browser; see test_console_browser.py).

The app is ``create_app`` over a real registry (SQLite, and PostgreSQL when reachable);
the console reaches it only through the admin API.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from server.admin.console.sessions import SessionStore
from server.app import create_app
from tests.server.admin.conftest import ADMIN_TOKEN, AUTH, OTHER_TOKEN, seed

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def browser(db, settings):
    app = create_app(settings, session_factory=db.factory)
    with TestClient(app, base_url="http://testserver") as c:
        yield c


def sign_in(c: TestClient, token: str = ADMIN_TOKEN) -> str:
    """Signs in; returns the session's CSRF token."""
    page = c.get("/console/signin")
    r = c.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": token}, follow_redirects=False)
    assert r.status_code == 303, r.text
    return CSRF.search(c.get("/console/tenants").text).group(1)


def test_pages_carry_security_headers(browser: TestClient) -> None:
    r = browser.get("/console/signin")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp and "form-action 'self'" in csp
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["cache-control"] == "no-store" and r.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in r.text and " style=" not in r.text  # nothing inline for the CSP to refuse
    js = browser.get("/console/static/htmx.min.js")
    assert js.status_code == 200 and js.text.startswith("/*! htmx.org 2.") and "Zero-Clause BSD" in js.text[:400]


def test_sign_in_sets_a_server_side_session(browser: TestClient) -> None:
    page = browser.get("/console/signin")
    r = browser.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": ADMIN_TOKEN},
                     follow_redirects=False)
    cookie = r.headers["set-cookie"]
    assert "kvgate_console=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/console" in cookie and "Secure" not in cookie  # plain http here; https sets Secure
    assert ADMIN_TOKEN not in cookie
    assert browser.get("/console/tenants").status_code == 200


def test_https_sets_secure_cookies(db, settings) -> None:
    with TestClient(create_app(settings, session_factory=db.factory), base_url="https://testserver") as c:
        page = c.get("/console/signin")
        assert "Secure" in page.headers["set-cookie"]
        r = c.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": ADMIN_TOKEN},
                   follow_redirects=False)
        assert "Secure" in r.headers["set-cookie"] and "SameSite=strict" in r.headers["set-cookie"]


@pytest.mark.parametrize("trusted, secure", [(None, False), ("10.42.0.0/16", True), ("*", True)])
def test_behind_a_tls_proxy_the_cookie_is_secure_from_trusted_proxies_only(db, monkeypatch, trusted, secure) -> None:
    """Served as `kvgate serve` serves it (its uvicorn config), reached from a TLS-terminating proxy at
    10.42.0.17 (not 127.0.0.1): uvicorn takes the scheme from X-Forwarded-Proto only when
    KVGATE_FORWARDED_ALLOW_IPS trusts the proxy; the default trusts 127.0.0.1 alone."""
    from server.cli.serve import uvicorn_config
    from tests.server.admin.conftest import make_settings

    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)  # uvicorn's own fallback: not what is tested
    settings = make_settings(db, **({"forwarded_allow_ips": trusted} if trusted else {}))
    config = uvicorn_config(create_app(settings, session_factory=db.factory), settings)
    config.load()
    https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    with TestClient(config.loaded_app, base_url="http://admin.example.com", client=("10.42.0.17", 51000)) as c:
        page = c.get("/console/signin", headers=https)
        assert ("Secure" in page.headers["set-cookie"]) is secure, page.headers["set-cookie"]
        # The client's own hop is http, where its jar keeps a Secure cookie back: send it as the browser would.
        pre = page.headers["set-cookie"].split(";", 1)[0]
        c.cookies.clear()
        r = c.post("/console/signin", headers={**https, "Cookie": pre}, follow_redirects=False,
                   data={"csrf": CSRF.search(page.text).group(1), "token": ADMIN_TOKEN})
        assert r.status_code == 303, r.text
        assert ("Secure" in r.headers["set-cookie"]) is secure, r.headers["set-cookie"]


def test_sign_in_refuses_bad_credentials_and_forged_forms(browser: TestClient) -> None:
    page = browser.get("/console/signin")
    token = CSRF.search(page.text).group(1)
    r = browser.post("/console/signin", data={"csrf": token, "token": "not-an-admin-token"})
    assert r.status_code == 401 and "refused" in r.text and "kvgate_console=" not in r.headers.get("set-cookie", "")
    # Without the sign-in form's token (its double-submit cookie), nothing is tried.
    r = browser.post("/console/signin", data={"token": ADMIN_TOKEN})
    assert r.status_code == 403
    assert browser.get("/console/tenants", follow_redirects=False).headers["location"] == "/console/signin"


def test_every_post_needs_the_session_csrf_token(browser: TestClient) -> None:
    seed(browser)
    key = browser.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": "k"}).json()
    csrf = sign_in(browser)
    forged = [
        ("/console/tenants", {"slug": "evil", "display_name": "Evil", "pool": "gpu-a", "retention_class": "gold"}),
        ("/console/tenants/acme/keys", {"name": "evil"}),
        (f"/console/tenants/acme/keys/{key['id']}/revoke", {}),
        ("/console/pools/gpu-a/replicas/r0/state", {"state": "disabled", "version": "1"}),
        ("/console/pools/gpu-a/captures", {}),
        ("/console/signout", {}),
    ]
    for path, form in forged:
        for extra in ({}, {"csrf": "x" * len(csrf)}):
            r = browser.post(path, data={**form, **extra}, follow_redirects=False)
            assert r.status_code == 403, (path, extra, r.status_code)
    assert browser.get("/admin/v1/tenants/evil", headers=AUTH).status_code == 404
    assert browser.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["total"] == 1
    assert browser.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["items"][0]["revoked_at"] is None
    assert browser.get("/admin/v1/pools/gpu-a/replicas/r0", headers=AUTH).json()["state"] == "active"
    # With the token but from another origin: refused too.
    r = browser.post(f"/console/tenants/acme/keys/{key['id']}/revoke", data={"csrf": csrf},
                     headers={"Origin": "http://evil.example"}, follow_redirects=False)
    assert r.status_code == 403
    # With the token, same origin: done, by the API, as the signed-in credential.
    r = browser.post(f"/console/tenants/acme/keys/{key['id']}/revoke", data={"csrf": csrf},
                     headers={"Origin": "http://testserver"}, follow_redirects=False)
    assert r.status_code == 303
    assert browser.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["items"][0]["revoked_at"] is not None
    events = browser.get("/admin/v1/audit", headers=AUTH, params={"entity_type": "api_key", "limit": 1}).json()
    assert events["items"][0]["actor"] == "admin:ops"


def test_created_key_is_shown_once(browser: TestClient) -> None:
    seed(browser)
    csrf = sign_in(browser)
    r = browser.post("/console/tenants/acme/keys", data={"csrf": csrf, "name": "web"})
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    secret = re.search(r'id="new-key-secret">([^<]+)<', r.text).group(1)
    assert secret.startswith("kvg_")
    assert secret not in browser.get("/console/tenants/acme").text
    assert "kvg_" not in browser.get("/console/tenants/acme").text


@pytest.mark.parametrize(("failing", "status", "reason"), [
    ("/tenants/acme/keys", 503, "registry unavailable"),
    ("/tenants/acme", 503, "registry unavailable"),
    ("/tenants/acme", 401, "no longer accepts this credential"),
])
def test_a_created_key_is_shown_when_the_page_cannot_be_refreshed(db, settings, monkeypatch, failing, status,
                                                                  reason) -> None:
    """The API created the key; reloading the tenant page then fails (its key list, the tenant itself, or
    the credential): the one-time secret is still on the answer, with an error saying the page was not
    refreshed."""
    from server.admin.console.api import AdminApi, ApiFailure

    with TestClient(create_app(settings, session_factory=db.factory)) as c:
        seed(c)
        csrf = sign_in(c)
        real = AdminApi.call

        async def flaky(self, method, path, **kw):  # type: ignore[no-untyped-def]
            if method == "GET" and path == failing:  # e.g. the registry unavailable right after the POST
                raise ApiFailure(status, "unavailable", "registry unavailable")
            return await real(self, method, path, **kw)

        monkeypatch.setattr(AdminApi, "call", flaky)
        r = c.post("/console/tenants/acme/keys", data={"csrf": csrf, "name": "web"}, follow_redirects=False)
        monkeypatch.undo()
        assert r.status_code == 201, r.text[:300]
        secret = re.search(r'id="new-key-secret">([^<]+)<', r.text).group(1)
        (key,) = c.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["items"]
        assert secret.startswith(f"kvg_{key['prefix']}_") and key["name"] == "web"
        flashes = re.findall(r'class="flash (\w+)"[^>]*>([^<]*)<', r.text)
        assert [kind for kind, _ in flashes] == ["error"], flashes
        assert "could not be refreshed" in flashes[0][1] and reason in flashes[0][1]
        assert "not created" not in r.text
        if status == 401:  # signed out by the API's refusal: the secret was shown all the same
            return

        async def refused(*_a, **_kw):  # type: ignore[no-untyped-def]
            raise ApiFailure(503, "unavailable", "registry unavailable")

        # A refused POST is still reported as not created, with no secret.
        monkeypatch.setattr(AdminApi, "call", refused)
        r = c.post("/console/tenants/acme/keys", data={"csrf": csrf, "name": "web2"}, follow_redirects=False)
        monkeypatch.undo()
        assert r.status_code == 303 and c.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["total"] == 1
        assert "Key not created: registry unavailable" in c.get("/console/tenants/acme").text


def test_api_errors_are_shown_not_500(browser: TestClient) -> None:
    seed(browser)
    csrf = sign_in(browser)
    r = browser.post("/console/tenants", data={"csrf": csrf, "slug": "acme", "display_name": "Again", "pool": "gpu-a",
                                               "retention_class": "gold"})
    assert r.status_code == 409 and "Tenant not created" in r.text and "409" in r.text
    r = browser.post("/console/tenants", data={"csrf": csrf, "slug": "x", "display_name": "X", "pool": "gpu-a",
                                               "retention_class": "gold", "rpm_limit": "many"})
    assert "rpm_limit must be a number" in r.text
    assert browser.get("/console/tenants/nobody").status_code == 404
    assert browser.get("/console/pools/nowhere").status_code == 404
    # Without a gateway there are no live figures: the page says so.
    assert "no gateway" in browser.get("/console/tenants/acme").text


def test_a_credential_the_api_drops_ends_the_session(db, settings) -> None:
    app = create_app(settings, session_factory=db.factory)
    with TestClient(app) as c:
        sign_in(c, OTHER_TOKEN)
        assert c.get("/console/tenants").status_code == 200
        # The API stops accepting the token (as a revoked or expired credential would be).
        app.state.admin_app.state.admin_credentials = tuple(
            (actor, token) for actor, token in app.state.admin_app.state.admin_credentials if token != OTHER_TOKEN)
        r = c.get("/console/tenants", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/console/signin?expired=1"
        assert len(app.state.console_app.state.sessions) == 0


def test_sessions_expire_when_idle_or_old_and_are_bounded() -> None:
    now = [0.0]
    store = SessionStore(idle_s=10, max_age_s=30, max_sessions=2, clock=lambda: now[0])
    sid, session = store.create(credential="c", name="n", role="viewer", tenants=None)
    assert store.get(sid) is session and store.get("forged") is None
    now[0] = 9.0
    assert store.get(sid) is session  # used: idle timer restarts
    now[0] = 25.0
    assert store.get(sid) is None  # idle 16 s > 10 s
    sid, _ = store.create(credential="c", name="n", role="viewer", tenants=None)
    for t in (35.0, 44.0, 53.0, 62.0):
        now[0] = t
        alive = store.get(sid) is not None
        assert alive == (t - 25.0 <= 30)  # never past max_age, however busy
    first, _ = store.create(credential="a", name="a", role="viewer", tenants=None)
    store.create(credential="b", name="b", role="viewer", tenants=None)
    store.create(credential="c", name="c", role="viewer", tenants=None)
    assert len(store) == 2 and store.get(first) is None  # the least recently used went first
    assert not session.check_csrf(None) and not session.check_csrf("") and session.check_csrf(session.csrf)


def test_a_refused_write_shows_the_api_status(browser: TestClient) -> None:
    seed(browser)
    key = browser.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": "k"}).json()
    csrf = sign_in(browser)
    r = browser.post(f"/console/tenants/nobody/keys/{key['id']}/revoke", data={"csrf": csrf})
    assert r.status_code == 404 and "tenant_not_found" in r.text
    assert browser.get("/admin/v1/tenants/acme/keys", headers=AUTH).json()["items"][0]["revoked_at"] is None


def test_a_scoped_viewer_lands_on_its_tenants_and_is_never_offered_pools(browser: TestClient) -> None:
    seed(browser)
    for name, tenants, landing in (("acme-viewer", ["acme"], "/console/tenants"), ("all-viewer", None, "/console/pools")):
        body = {"name": name, "role": "viewer", **({"tenants": tenants} if tenants else {})}
        secret = browser.post("/admin/v1/credentials", headers=AUTH, json=body).json()["secret"]
        browser.cookies.clear()
        page = browser.get("/console/signin")
        r = browser.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": secret},
                         follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].endswith(landing), (name, r.headers)
        home = browser.get(r.headers["location"])
        assert home.status_code == 200, (name, home.text)
        offered = 'href="/console/pools' in browser.get("/console/tenants").text
        assert offered == (tenants is None), name


def test_console_files_ship_as_package_data() -> None:
    """Every template and static file of the console is covered by pyproject's package-data globs."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server"]
    console = root / "server" / "admin" / "console"
    files = [p.relative_to(root / "server").as_posix() for folder in ("templates", "static")
             for p in (console / folder).rglob("*") if p.is_file()]
    assert "admin/console/static/htmx.min.js" in files and "admin/console/templates/base.html" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def sign_in_as(c: TestClient, secret: str) -> str:
    """Signs in with a fresh cookie jar; returns the session's CSRF token."""
    c.cookies.clear()
    return sign_in(c, secret)


def credential(c: TestClient, role: str, **extra: object) -> str:
    r = c.post("/admin/v1/credentials", headers=AUTH, json={"name": f"{role}-x", "role": role, **extra})
    assert r.status_code == 201, r.text
    return r.json()["secret"]


def test_an_operator_opens_tenant_pages_without_the_keys_card(browser: TestClient) -> None:
    from server.admin.console.pages import CAN
    from server.admin.permissions import RULES

    seed(browser)
    browser.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": "k"})
    sign_in_as(browser, credential(browser, "operator"))
    r = browser.get("/console/tenants")
    assert r.status_code == 200 and 'href="/console/tenants/acme"' in r.text
    r = browser.get("/console/tenants/acme")
    assert r.status_code == 200, r.text
    assert "Acme" in r.text and 'id="limits"' in r.text and 'id="keys"' not in r.text and "create-key" not in r.text
    # The console hides what the API refuses: its key permissions are the API's.
    assert CAN["key.read"] == RULES[("GET", "/tenants/{ref}/keys")].roles
    assert CAN["key.write"] == RULES[("POST", "/tenants/{ref}/keys")].roles
    # A viewer reads keys (and is offered no key form); a platform admin gets both.
    sign_in_as(browser, credential(browser, "viewer"))
    r = browser.get("/console/tenants/acme")
    assert r.status_code == 200 and 'id="keys"' in r.text and "create-key" not in r.text
    sign_in_as(browser, ADMIN_TOKEN)
    r = browser.get("/console/tenants/acme")
    assert 'id="keys"' in r.text and 'id="create-key"' in r.text


def assert_console_page(r, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
    assert r.headers["cache-control"] == "no-store"
    assert f'id="error-code">{status}<' in r.text


def test_non_finite_numbers_are_refused_not_500(browser: TestClient) -> None:
    seed(browser)
    csrf = sign_in(browser)
    for value in ("nan", "inf", "-Infinity", "1e999"):
        r = browser.post("/console/tenants", data={"csrf": csrf, "slug": "n1", "display_name": "N", "pool": "gpu-a",
                                                   "retention_class": "gold", "kv_quota_fraction": value})
        assert r.status_code == 422 and "kv_quota_fraction must be a number" in r.text, (value, r.status_code)
        r = browser.post("/console/pools/gpu-a/captures", data={"csrf": csrf, "sample_rate": value})
        assert r.status_code == 422 and "sample rate must be a number" in r.text, (value, r.status_code)
    assert browser.get("/admin/v1/tenants/n1", headers=AUTH).status_code == 404
    assert browser.get("/admin/v1/pools/gpu-a/captures", headers=AUTH).json()["total"] == 0


def test_a_non_ascii_credential_gets_the_signin_page(browser: TestClient) -> None:
    page = browser.get("/console/signin")
    r = browser.post("/console/signin", data={"csrf": CSRF.search(page.text).group(1), "token": "kva_caf\u00e9"})
    assert r.status_code == 400 and 'id="signin-error"' in r.text
    assert r.headers["x-frame-options"] == "DENY" and "kvgate_console=" not in r.headers.get("set-cookie", "")


def test_console_errors_are_console_pages_and_only_there(db, settings, monkeypatch) -> None:
    from server.admin.console.api import AdminApi

    app = create_app(settings, session_factory=db.factory)
    with TestClient(app, raise_server_exceptions=False) as c:
        seed(c)
        csrf = sign_in(c)
        r = c.get("/console/nope")
        assert_console_page(r, 404)
        r = c.post("/console/tenants/acme/keys/abc/revoke", data={"csrf": csrf})
        assert_console_page(r, 422)
        assert "key_id" in r.text and '"detail"' not in r.text

        async def broken(*_a, **_kw):
            raise RuntimeError("secret internals")

        monkeypatch.setattr(AdminApi, "call", broken)
        r = c.get("/console/tenants")
        assert_console_page(r, 500)
        assert "secret internals" not in r.text
        monkeypatch.undo()
        # The admin API and the root app keep their own error shapes.
        r = c.get("/admin/v1/tenants/acme/keys/abc/revoke", headers=AUTH)
        assert r.headers["content-type"].startswith("application/json") and "error" in r.json()
        r = c.get("/admin/v1/nope", headers=AUTH)
        assert r.headers["content-type"].startswith("application/json")
        r = c.get("/nope")
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")


def test_static_files_are_cached_and_pages_are_not(browser: TestClient) -> None:
    for path in ("/console/static/console.css", "/console/static/htmx.min.js"):
        r = browser.get(path)
        assert r.status_code == 200 and r.headers["cache-control"] == "public, max-age=3600", path
        assert r.headers["x-content-type-options"] == "nosniff"
    assert browser.get("/console/signin").headers["cache-control"] == "no-store"


def test_pools_page_shows_pool_totals_before_the_first_poll(browser: TestClient) -> None:
    r = browser.post("/admin/v1/pools", headers=AUTH, json={
        "name": "duo", "model_name": "m", "primary_blocks": 128, "secondary_blocks": 256,
        "replicas": [{"name": "r0", "endpoint": "127.0.0.1:9200"}, {"name": "r1", "endpoint": "127.0.0.1:9201"}]})
    assert r.status_code == 201, r.text
    sign_in(browser)
    row = re.search(r'<tr data-pool="duo">(.*?)</tr>', browser.get("/console/pools").text, re.S).group(1)
    assert "256 registered" in row and "512 registered" in row, row  # 2 replicas x 128 GPU / 256 host blocks


def test_pool_page_says_a_new_budget_is_not_yet_loaded(db, settings) -> None:
    from prometheus_client import CollectorRegistry

    from server.gateway.observe.slo_guard import SloGuards

    app = create_app(settings, session_factory=db.factory)
    with TestClient(app) as c:
        seed(c)
        # This gateway's guard before its first tick: it has loaded no budget yet.
        app.state.admin_app.state.slo_guard = SloGuards(session_factory=db.factory, pools=lambda: [],
                                                        registry=CollectorRegistry())
        sign_in(c)
        slo = lambda: re.search(r'<section class="card" id="slo">(.*?)<h3>', c.get("/console/pools/gpu-a").text,  # noqa: E731
                                re.S).group(1)
        assert "No SLO budget set" in slo()
        assert c.put("/admin/v1/pools/gpu-a/slo", headers=AUTH, json={"ttft_p99_ms": 800}).status_code == 200
        panel = slo()
        assert "No SLO budget set" not in panel and "not yet loaded by this gateway" in panel and "800" in panel


def test_replica_buttons_keep_ids_and_errors_are_alerts(browser: TestClient) -> None:
    seed(browser)
    csrf = sign_in(browser)
    text = browser.get("/console/pools/gpu-a").text
    buttons = re.findall(r"<button[^>]*data-replica-action[^>]*>", text)
    assert len(buttons) == 2, buttons
    for b in buttons:
        assert re.search(r'id="replica-r0-(draining|disabled)"', b) and re.search(r'aria-label="\w+ replica r0"', b), b
    assert browser.get("/console/pools/gpu-a/live").text.count('id="replica-r0-') == 2
    r = browser.post("/console/pools/gpu-a/replicas/r0/state", data={"csrf": csrf, "state": "draining", "version": "99"})
    assert 'class="flash error" role="alert"' in r.text


def test_a_refused_form_comes_back_filled_in_with_the_reason(browser: TestClient) -> None:
    seed(browser)
    csrf = sign_in(browser)
    form = {"csrf": csrf, "slug": "acme", "display_name": "Acme again", "pool": "gpu-a", "retention_class": "gold",
            "isolation": "shared", "kv_quota_fraction": "0.3", "rpm_limit": "77", "tpm_limit": "9000",
            "max_concurrent_requests": "3"}
    r = browser.post("/console/tenants", data=form, follow_redirects=False)
    assert r.status_code == 409, r.status_code  # the API's status, not a redirect to a blank form
    for name in ("display_name", "kv_quota_fraction", "rpm_limit", "tpm_limit", "max_concurrent_requests"):
        assert re.search(rf'name="{name}"[^>]*value="{re.escape(form[name])}"', r.text), name
    assert re.search(r'<option value="shared" selected>', r.text)
    assert re.search(r'id="error-slug"[^>]*>[^<]*already', r.text), r.text  # the reason, next to its field
    assert 'pattern="[a-z0-9][a-z0-9._\\-]*"' in r.text
    r = browser.post("/console/tenants", data={**form, "slug": "acme2", "kv_quota_fraction": "1.5"})
    assert r.status_code == 422 and re.search(r'id="error-kv_quota_fraction"[^>]*>', r.text)
    assert re.search(r'name="slug"[^>]*value="acme2"', r.text)
    r = browser.post("/console/tenants", data={**form, "slug": "acme3", "rpm_limit": "many"})
    assert r.status_code == 422 and re.search(r'id="error-rpm_limit"[^>]*>rpm_limit must be a number', r.text)
    assert browser.get("/admin/v1/tenants", headers=AUTH).json()["total"] == 1
    # Start capture: the same.
    r = browser.post("/console/pools/gpu-a/captures", data={"csrf": csrf, "sample_rate": "5", "tenant": "acme"})
    assert r.status_code == 422 and re.search(r'id="error-sample_rate"', r.text)
    assert re.search(r'name="sample_rate"[^>]*value="5"', r.text) and re.search(r'name="tenant"[^>]*value="acme"', r.text)
