"""The web console in a real browser (Debian's chromium via Selenium) against a real stack.

The stack is ``tests/server/gateway/stack.py``'s: the reference engine in a child
process, the app ``kvgate serve`` builds on uvicorn at 127.0.0.1, a migrated SQLite
registry. Every figure the console shows comes from the admin API, and the KV figures
from the engine's own stats and per-request KV metrics.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from server.admin import create_admin_app
from server.settings import Settings
from tests.server.gateway.stack import MODEL, Stack, build_stack

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")

TPB = 16
ENGINE_ARGS = ["--tokens-per-block", str(TPB), "--primary-blocks", "256", "--secondary-blocks", "512",
               "--max-input-len", "1024", "--max-output-len", "16", "--max-batch-size", "4"]
SYSTEM = ("You are the support assistant of a hardware shop. Answer in one short sentence, politely, and never "
          "invent prices or stock levels; if unsure, say so and offer to ask a colleague. ") * 3


def whoami_status() -> int:
    """What ``GET /admin/v1/whoami`` answers a bootstrap token on this checkout (404 until it exists)."""
    token = "probe-" + "0" * 32
    settings = Settings(database_url="sqlite://", admin_tokens=[f"probe:{token}"], key_pepper="p" * 40)
    app = create_admin_app(settings=settings, session_factory=sessionmaker(), clock=lambda: None)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        return client.get("/whoami", headers={"Authorization": f"Bearer {token}"}).status_code


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    built = build_stack(tmp_path_factory.mktemp("console"), engine_args=ENGINE_ARGS, tokens_per_block=TPB,
                        primary=256, secondary=512, engine_timeout=300.0, settings={"mrc_sample_rate": 1.0})
    yield built
    built.gateway.stop()
    built.engine.kill()


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1360,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.implicitly_wait(0)
    yield browser
    browser.quit()


def admin(stack: Stack, method: str, path: str, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {kw.pop('token', stack.admin_token)}"}
    return httpx.request(method, stack.gateway.base_url + "/admin/v1" + path, headers=headers, timeout=30, **kw)


def wait_for(driver, predicate, timeout: float = 60.0, message: str = ""):
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    # The live panels are swapped in place while a predicate reads them: an element found just
    # before a swap is stale, and the next poll finds the new one. Chromium may instead answer
    # such a read with an "unhandled inspector error" (seen once in a full run): the same race, so
    # the same retry; any other driver error fails the test.
    def poll(d):  # noqa: ANN001, ANN202
        try:
            return predicate(d)
        except WebDriverException as exc:
            if "unhandled inspector error" not in str(exc):
                raise
            return False

    return WebDriverWait(driver, timeout, poll_frequency=0.25,
                         ignored_exceptions=(StaleElementReferenceException,)).until(poll, message)


def by(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def all_by(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def sign_in(driver, stack: Stack, credential: str) -> None:
    driver.delete_all_cookies()
    driver.get(stack.gateway.base_url + "/console/signin")
    by(driver, "#token").send_keys(credential)
    by(driver, "#signin button[type=submit]").click()
    wait_for(driver, lambda d: all_by(d, "#whoami"), message="not signed in")


def forged_post(driver, path: str, form: dict[str, str]) -> dict:
    """A same-origin POST from script with the session cookie (what a CSRF attack would ride on)."""
    return driver.execute_async_script(
        """const [path, form, done] = arguments;
        fetch(path, {method: 'POST', credentials: 'same-origin', redirect: 'manual',
                     headers: {'Content-Type': 'application/x-www-form-urlencoded'},
                     body: new URLSearchParams(form).toString()})
          .then(r => r.text().then(t => done({status: r.status, body: t})))
          .catch(e => done({status: -1, body: String(e)}));""", path, form)


def chat(stack: Stack, key: str, question: str) -> httpx.Response:
    return httpx.post(stack.gateway.base_url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})


def test_console_tenant_key_kv_and_csrf(stack: Stack, driver) -> None:
    base = stack.gateway.base_url
    sign_in(driver, stack, stack.admin_token)
    assert by(driver, "#whoami").get_attribute("data-role") == "platform-admin"
    page = httpx.get(base + "/console/signin")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp

    # Create a tenant through the form.
    driver.get(base + "/console/tenants")
    form = by(driver, "#create-tenant")
    form.find_element("name", "slug").send_keys("shop")
    form.find_element("name", "display_name").send_keys("Hardware shop")
    form.find_element("name", "kv_quota_fraction").clear()
    form.find_element("name", "kv_quota_fraction").send_keys("0.25")
    form.find_element("css selector", "button[type=submit]").click()
    wait_for(driver, lambda d: d.current_url.endswith("/console/tenants/shop"), message="no tenant page")
    assert "Tenant shop created." in by(driver, ".flash.ok").text
    assert admin(stack, "GET", "/tenants/shop").json()["kv_quota_fraction"] == 0.25

    # Create a key: its secret is on the answer page, once.
    form = by(driver, "#create-key")
    form.find_element("name", "name").send_keys("browser")
    form.find_element("css selector", "button[type=submit]").click()
    secret = wait_for(driver, lambda d: all_by(d, "#new-key-secret") and by(d, "#new-key-secret").text.strip())
    keys = admin(stack, "GET", "/tenants/shop/keys").json()["items"]
    assert len(keys) == 1 and secret.startswith(f"kvg_{keys[0]['prefix']}_")
    key_id = keys[0]["id"]
    driver.get(base + "/console/tenants/shop")
    assert secret not in driver.page_source and not all_by(driver, "#new-key")

    # Traffic through the gateway with that key; the open page's KV panel updates by itself.
    figures = by(driver, "#kv-figures")
    assert figures.get_attribute("data-requests") == "0" and figures.get_attribute("data-primary") == "0"
    assert not all_by(driver, "#kv-panel polyline")
    driver.execute_script("window.__sameDocument = 'yes';")
    for question in ("Do you sell drills?", "Do you sell hammers?", "Do you sell drills?"):
        assert chat(stack, secret, question).status_code == 200
    wait_for(driver, lambda d: int(by(d, "#kv-figures").get_attribute("data-requests")) >= 3
             and int(by(d, "#kv-figures").get_attribute("data-primary")) > 0, timeout=30,
             message="KV panel did not update after traffic")
    assert driver.execute_script("return window.__sameDocument") == "yes"  # swapped by htmx, not reloaded
    kv = admin(stack, "GET", "/tenants/shop/kv").json()
    assert kv["requests"] == 3 and kv["reused_blocks"] > 0 and kv["primary_blocks"] > 0
    wait_for(driver, lambda d: all_by(d, "#kv-panel polyline[data-series=shop]"), timeout=30, message="no MRC line")
    assert int(by(driver, "#kv-panel polyline[data-series=shop]").get_attribute("data-points")) >= 4
    bar = by(driver, "#kv-panel rect.fill")
    assert int(bar.get_attribute("data-blocks")) == int(by(driver, "#kv-figures").get_attribute("data-primary"))

    # A forged POST (session cookie, no CSRF token) is refused and changes nothing.
    csrf = by(driver, "#create-key input[name=csrf]").get_attribute("value")
    for form_fields in ({}, {"csrf": "forged-" + csrf[:8]}):
        answer = forged_post(driver, f"/console/tenants/shop/keys/{key_id}/revoke", form_fields)
        assert answer["status"] == 403, answer
    assert admin(stack, "GET", "/tenants/shop/keys").json()["items"][0]["revoked_at"] is None
    assert chat(stack, secret, "Still there?").status_code == 200

    # Revoke from the page: the gateway refuses the key at once.
    by(driver, f"button[data-revoke='{key_id}']").click()
    wait_for(driver, lambda d: all_by(d, f"tr[data-key-id='{key_id}'][data-state=revoked]"), message="not revoked")
    assert admin(stack, "GET", "/tenants/shop/keys").json()["items"][0]["revoked_at"] is not None
    assert chat(stack, secret, "And now?").status_code == 401

    # No console page ran a script the CSP refused (htmx must work under it).
    errors = [e for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
    assert errors == []


def test_console_pool_drain_through_the_api(stack: Stack, driver) -> None:
    base = stack.gateway.base_url
    sign_in(driver, stack, stack.admin_token)
    driver.get(base + "/console/pools/reference")
    row = "#replicas tr[data-replica=r0]"
    wait_for(driver, lambda d: "closed" in by(d, row).text, timeout=30, message="breaker state not shown")
    by(driver, f"{row} button[data-replica-action=draining]").click()
    wait_for(driver, lambda d: by(d, row).get_attribute("data-state") == "draining", message="not draining")
    assert admin(stack, "GET", "/pools/reference/replicas/r0").json()["state"] == "draining"
    audit = admin(stack, "GET", "/audit", params={"entity_type": "pool_replica", "limit": 1}).json()["items"]
    assert audit and audit[0]["actor"] == "admin:ci"  # the API did it, as the signed-in credential
    by(driver, f"{row} button[data-replica-action=active]").click()
    wait_for(driver, lambda d: by(d, row).get_attribute("data-state") == "active", message="not active again")
    assert admin(stack, "GET", "/pools/reference/replicas/r0").json()["state"] == "active"
    # A stale version (the page's form after someone else's change) is the API's 409, shown as a message.
    stale = by(driver, f"{row} input[name=version]").get_attribute("value")
    admin(stack, "PATCH", "/pools/reference/replicas/r0", json={"version": int(stale), "weight": 2})
    by(driver, f"{row} button[data-replica-action=draining]").click()
    wait_for(driver, lambda d: all_by(d, ".flash.error"), message="no error shown")
    assert "stale_version" in by(driver, ".flash.error").text
    assert admin(stack, "GET", "/pools/reference/replicas/r0").json()["state"] == "active"


def test_console_session_cookie_and_signout(stack: Stack, driver) -> None:
    base = stack.gateway.base_url
    sign_in(driver, stack, stack.admin_token)
    cookie = driver.get_cookie("kvgate_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert stack.admin_token not in cookie["value"]
    assert driver.execute_script("return document.cookie") == ""  # nothing readable by script
    by(driver, "form[action='/console/signout'] button").click()
    wait_for(driver, lambda d: d.current_url.startswith(base + "/console/signin"))
    driver.add_cookie({"name": "kvgate_console", "value": cookie["value"], "path": "/console"})
    driver.get(base + "/console/tenants")
    assert driver.current_url.startswith(base + "/console/signin")  # the old session id is dead
    by(driver, "#token").send_keys("not-a-credential")
    by(driver, "#signin button[type=submit]").click()
    assert "refused" in wait_for(driver, lambda d: all_by(d, "#signin-error") and by(d, "#signin-error").text)


@pytest.mark.skipif(whoami_status() == 404, reason="GET /admin/v1/whoami is not in this admin API yet (scoped admin "
                    "credentials); the console signs bootstrap tokens in as platform admins until then")
def test_console_tenant_admin_sees_only_its_tenant(stack: Stack, driver) -> None:
    base = stack.gateway.base_url
    for slug in ("ta-one", "ta-two"):
        assert admin(stack, "POST", "/tenants", json={"slug": slug, "display_name": slug, "pool": "reference",
                                                      "retention_class": "standard"}).status_code == 201
    other_key = admin(stack, "POST", "/tenants/ta-two/keys", json={"name": "theirs"}).json()
    created = admin(stack, "POST", "/credentials", json={"name": "ta-one-admin", "role": "tenant-admin",
                                                         "tenants": ["ta-one"], "expires_at": None})
    assert created.status_code == 201, created.text
    sign_in(driver, stack, created.json()["secret"])
    assert by(driver, "#whoami").get_attribute("data-role") == "tenant-admin"
    assert not all_by(driver, "header nav a[href='/console/pools']")  # hidden for the role
    driver.get(base + "/console/tenants")
    assert [r.get_attribute("data-tenant") for r in all_by(driver, "#tenants tr[data-tenant]")] == ["ta-one"]
    assert not all_by(driver, "#create-tenant")
    driver.get(base + "/console/tenants/ta-two")
    assert by(driver, "#error-code").text == "404"
    # Forged: a valid session and CSRF token, aimed at another tenant's key. The API refuses it.
    driver.get(base + "/console/tenants/ta-one")
    csrf = by(driver, "#create-key input[name=csrf]").get_attribute("value")
    answer = forged_post(driver, f"/console/tenants/ta-two/keys/{other_key['id']}/revoke", {"csrf": csrf})
    assert answer["status"] == 404, answer
    assert admin(stack, "GET", "/tenants/ta-two/keys").json()["items"][0]["revoked_at"] is None


def test_console_slug_pattern_is_the_apis_and_valid_in_chromium(stack: Stack, driver) -> None:
    # Chromium compiles a pattern with the v flag and silently drops one it cannot compile:
    # then any slug passes the browser's check. The pattern must compile and match the API's names.
    sign_in(driver, stack, stack.admin_token)
    driver.get(stack.gateway.base_url + "/console/tenants")
    slug = by(driver, "#create-tenant [name=slug]")
    valid = {}
    for value in ("acme", "acme.eu", "acme_eu", "acme-eu", "Acme", "-acme", "acme eu"):
        driver.execute_script("arguments[0].value = arguments[1]", slug, value)
        valid[value] = driver.execute_script("return arguments[0].checkValidity()", slug)
    assert valid == {"acme": True, "acme.eu": True, "acme_eu": True, "acme-eu": True,
                     "Acme": False, "-acme": False, "acme eu": False}
    assert not [e for e in driver.get_log("browser") if "pattern" in e["message"]]


def test_console_replica_panel_poll_keeps_keyboard_focus(stack: Stack, driver) -> None:
    sign_in(driver, stack, stack.admin_token)
    driver.get(stack.gateway.base_url + "/console/pools/reference")
    button = "#pool-live tr[data-replica=r0] button[data-replica-action=draining]"
    wait_for(driver, lambda d: all_by(d, button), timeout=30, message="no drain button")
    driver.execute_script("const b = document.querySelector(arguments[0]); window.__focused = b; b.focus();"
                          "document.getElementById('pool-live').dataset.old = 'yes';", button)
    # The panel is swapped by its next poll (every 3 s): a new button, and focus must follow to it.
    wait_for(driver, lambda d: not all_by(d, "#pool-live[data-old]"), timeout=15, message="panel not refreshed")
    active = driver.execute_script(
        "const a = document.activeElement; return [a.tagName, a.id, a.getAttribute('aria-label'), a === window.__focused]")
    assert active == ["BUTTON", "replica-r0-draining", "Drain replica r0", False], active
