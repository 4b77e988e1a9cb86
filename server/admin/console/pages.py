"""The console's pages: sign-in, tenants (limits, keys, usage, KV), pools (replicas, SLO guard, captures).

Thin handlers: read the session, call the admin API (``api.py``) with its credential,
render a template. Writes are plain HTML forms (POST, CSRF token in a hidden field) that
redirect back (303) with a flash message, except key creation, whose answer is the page
that shows the new secret once. htmx only polls the live panels (GET fragments).

Invariants: every POST handler starts with :func:`_posted` (session + CSRF + origin);
no handler reaches the registry except through :class:`AdminApi`; a 401 from the API
ends the session (the credential was revoked or expired).
"""

from __future__ import annotations

import hmac
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from server.admin.console import charts
from server.admin.console.api import AdminApi, ApiFailure
from server.admin.console.sessions import COOKIE, PRE_COOKIE, ConsoleSession, SessionStore

CONSOLE_PREFIX = "/console"
HERE = Path(__file__).parent

# script and style only from this origin: htmx's file and console.css; no inline code at all.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages can hold a key's secret (shown once) and tenant data
}

# What each role may do, to hide the controls it cannot use. The admin API enforces; this only hides.
CAN: dict[str, frozenset[str]] = {
    "tenant.create": frozenset({"platform-admin"}),
    "key.write": frozenset({"platform-admin", "tenant-admin"}),
    "pools.read": frozenset({"platform-admin", "operator", "viewer"}),
    "replica.state": frozenset({"platform-admin", "operator"}),
    "slo.restore": frozenset({"platform-admin", "operator"}),
    "capture.write": frozenset({"platform-admin", "operator"}),
}
UNSCOPED_ONLY = frozenset({"pools.read"})  # whatever the role, not for a session scoped to tenants
REPLICA_STATES = ("active", "draining", "disabled")


class SignInRequired(Exception):
    """No live session (or the API no longer accepts its credential): go to the sign-in page."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message)
        self.message = message


class Refused(Exception):
    """A POST without a valid CSRF token or from another origin: 403, nothing done."""


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _url(path: str) -> str:
    return CONSOLE_PREFIX + path


def _q(part: str) -> str:
    return quote(part, safe="")


def build(*, api_app: Any, idle_s: float, max_age_s: float) -> FastAPI:
    app = FastAPI(title="kvgate console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sessions = SessionStore(idle_s=idle_s, max_age_s=max_age_s)
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescapes .html
    templates.env.globals.update(base=CONSOLE_PREFIX, q=_q, states=REPLICA_STATES)
    templates.env.filters["pct"] = lambda v: "—" if v is None else f"{v * 100:.1f}%"
    templates.env.filters["num"] = lambda v: "—" if v is None else (f"{v:,.0f}" if isinstance(v, (int, float)) else v)
    templates.env.filters["when"] = lambda v: "—" if not v else str(v).replace("T", " ")[:19]
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    sessions: SessionStore = app.state.sessions

    @app.middleware("http")
    async def security_headers(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if request.url.path.startswith("/static/"):
            response.headers["Cache-Control"] = "public, max-age=3600"
        return response

    @app.exception_handler(SignInRequired)
    async def to_signin(request: Request, exc: SignInRequired) -> Response:
        target = _url("/signin") + ("?expired=1" if exc.message else "")
        if request.headers.get("HX-Request"):
            return Response(status_code=204, headers={"HX-Redirect": target})
        response = RedirectResponse(target, status_code=303)
        response.delete_cookie(COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=_secure(request))
        return response

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        return templates.TemplateResponse(request, "error.html", {"me": None, "flashes": [], "code": 403,
                                                                        "message": str(exc)},
                                          status_code=403)

    # --- helpers -------------------------------------------------------------------------

    def session_of(request: Request) -> ConsoleSession:
        session = sessions.get(request.cookies.get(COOKIE))
        if session is None:
            raise SignInRequired()
        return session

    def api_for(session: ConsoleSession) -> AdminApi:
        return AdminApi(api_app, session.credential)

    def can(session: ConsoleSession, action: str) -> bool:
        if action in UNSCOPED_ONLY and session.tenants is not None:  # the API refuses pools to a scoped caller
            return False
        return session.role in CAN[action]

    async def _posted(request: Request) -> tuple[ConsoleSession, dict[str, str]]:
        """The session and form of a POST, after the origin and CSRF checks."""
        _same_origin(request)
        session = session_of(request)
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        if not session.check_csrf(form.get("csrf") or request.headers.get("X-CSRF-Token")):
            raise Refused("missing or invalid CSRF token: reload the page and try again")
        return session, form

    def _same_origin(request: Request) -> None:
        # Defence in depth beside the token: a browser names the page's origin on a POST.
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            parts = urlsplit(origin)
            if parts.netloc != request.headers.get("host", ""):
                raise Refused("cross-origin form refused")

    async def ask(request: Request, session: ConsoleSession, method: str, path: str, **kw: Any) -> Any:
        """An API call; a 401 ends the session (the credential was revoked or expired)."""
        try:
            if method == "GET":
                return await api_for(session).get(path, **kw)
            return await api_for(session).call(method, path, **kw)
        except ApiFailure as exc:
            if exc.status == 401:
                sessions.drop(request.cookies.get(COOKIE))
                raise SignInRequired("the admin API no longer accepts this credential") from exc
            raise

    async def maybe(request: Request, session: ConsoleSession, path: str, **kw: Any) -> tuple[Any, ApiFailure | None]:
        try:
            return await ask(request, session, "GET", path, **kw), None
        except ApiFailure as exc:
            return None, exc

    def page(request: Request, session: ConsoleSession | None, name: str, status: int = 200, *,
             fragment: bool = False, **context: Any) -> Response:
        # A polled fragment must not consume the flash messages meant for the next full page.
        ctx = {"me": session, "flashes": session.take_flashes() if session and not fragment else [],
               "can": (lambda action: session is not None and can(session, action)), **context}
        return templates.TemplateResponse(request, name, ctx, status_code=status)

    def back(session: ConsoleSession, path: str, kind: str | None = None, message: str | None = None) -> Response:
        if kind and message:
            session.flash(kind, message)
        return RedirectResponse(_url(path), status_code=303)

    def failed(request: Request, session: ConsoleSession, exc: ApiFailure) -> Response:
        code = exc.status if exc.status >= 400 else 502
        return page(request, session, "error.html", status=code, code=code, message=str(exc))

    # --- sign-in -------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        session = session_of(request)
        return RedirectResponse(_url("/pools" if can(session, "pools.read") else "/tenants"), status_code=303)

    def signin_page(request: Request, error: str | None, status: int = 200) -> Response:
        token = secrets.token_urlsafe(32)
        response = templates.TemplateResponse(request, "signin.html", {"me": None, "flashes": [], "error": error,
                                                                       "csrf": token}, status_code=status)
        response.set_cookie(PRE_COOKIE, token, max_age=600, path=CONSOLE_PREFIX, httponly=True, samesite="strict",
                            secure=_secure(request))
        return response

    @app.get("/signin", response_class=HTMLResponse)
    async def signin_form(request: Request, expired: int = 0) -> Response:
        return signin_page(request, "Your session ended: sign in again." if expired else None)

    @app.post("/signin")
    async def signin(request: Request) -> Response:
        _same_origin(request)
        form = await request.form()
        presented, expected = str(form.get("csrf") or ""), request.cookies.get(PRE_COOKIE) or ""
        if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
            raise Refused("missing or invalid sign-in token: reload the sign-in page")
        credential = str(form.get("token") or "").strip()
        if not credential or len(credential) > 4096 or any(c.isspace() for c in credential):
            return signin_page(request, "Paste an admin credential (a bearer token).", 400)
        try:
            me = await AdminApi(api_app, credential).whoami()
        except ApiFailure as exc:
            message = "The admin API refused this credential." if exc.status in (401, 403) else str(exc)
            return signin_page(request, message, 401 if exc.status in (401, 403) else 502)
        tenants = me.get("tenants")
        session_id, session = sessions.create(credential=credential, name=str(me.get("name") or "admin"),
                                              role=str(me.get("role") or "viewer"),
                                              tenants=tuple(tenants) if tenants is not None else None)
        response = RedirectResponse(_url("/pools" if can(session, "pools.read") else "/tenants"), status_code=303)
        response.set_cookie(COOKIE, session_id, path=CONSOLE_PREFIX, httponly=True, samesite="strict",
                            secure=_secure(request), max_age=int(max_age_s))
        response.delete_cookie(PRE_COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=_secure(request))
        return response

    @app.post("/signout")
    async def signout(request: Request) -> Response:
        await _posted(request)
        sessions.drop(request.cookies.get(COOKIE))
        response = RedirectResponse(_url("/signin"), status_code=303)
        response.delete_cookie(COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=_secure(request))
        return response

    # --- tenants -------------------------------------------------------------------------

    @app.get("/tenants", response_class=HTMLResponse)
    async def tenants(request: Request) -> Response:
        session = session_of(request)
        listing, error = await maybe(request, session, "/tenants", limit=500)
        if error is not None:
            return failed(request, session, error)
        pools = classes = None
        if can(session, "tenant.create"):
            pools, _ = await maybe(request, session, "/pools", limit=500)
            classes, _ = await maybe(request, session, "/retention-classes", limit=500)
        return page(request, session, "tenants.html", tenants=listing["items"], total=listing["total"],
                    pools=(pools or {}).get("items", []), classes=(classes or {}).get("items", []))

    @app.post("/tenants")
    async def create_tenant(request: Request) -> Response:
        session, form = await _posted(request)
        body: dict[str, Any] = {k: form[k].strip() for k in ("slug", "display_name", "pool", "retention_class",
                                                              "isolation") if form.get(k, "").strip()}
        try:
            for name, kind in (("kv_quota_fraction", float), ("rpm_limit", int), ("tpm_limit", int),
                               ("max_concurrent_requests", int)):
                if form.get(name, "").strip():
                    body[name] = kind(form[name])
        except ValueError:
            return back(session, "/tenants", "error", f"{name} must be a number")
        try:
            created = await ask(request, session, "POST", "/tenants", json=body)
        except ApiFailure as exc:
            return back(session, "/tenants", "error", f"Tenant not created: {exc}")
        return back(session, f"/tenants/{_q(created['slug'])}", "ok", f"Tenant {created['slug']} created.")

    async def tenant_context(request: Request, session: ConsoleSession, slug: str) -> dict[str, Any]:
        ref = _q(slug)
        tenant = await ask(request, session, "GET", f"/tenants/{ref}")
        keys = await ask(request, session, "GET", f"/tenants/{ref}/keys", limit=500)
        since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
        usage, usage_error = await maybe(request, session, f"/tenants/{ref}/usage", limit=60, **{"from": since})
        return {"tenant": tenant, "keys": keys["items"], "usage": usage, "usage_error": usage_error,
                **await kv_context(request, session, slug)}

    async def kv_context(request: Request, session: ConsoleSession, slug: str) -> dict[str, Any]:
        kv, kv_error = await maybe(request, session, f"/tenants/{_q(slug)}/kv")
        chart = bars = None
        if kv is not None:
            bars = charts.blocks_chart(
                [("GPU (primary)", kv["primary_blocks"], kv["quota_blocks"], kv["pool_primary_blocks"]),
                 ("host (secondary)", kv["secondary_blocks"], None, kv["pool_secondary_blocks"])],
                title=f"KV blocks held by {slug}")
            chart = charts.miss_ratio_chart([(slug, "tenant", kv["mrc"])], title=f"Miss-ratio curve of {slug}")
        return {"slug": slug, "kv": kv, "kv_error": kv_error, "kv_bars": bars, "kv_chart": chart}

    @app.get("/tenants/{slug}", response_class=HTMLResponse)
    async def tenant(request: Request, slug: str) -> Response:
        session = session_of(request)
        try:
            context = await tenant_context(request, session, slug)
        except ApiFailure as exc:
            return failed(request, session, exc)
        return page(request, session, "tenant.html", new_key=None, **context)

    @app.get("/tenants/{slug}/kv", response_class=HTMLResponse)
    async def tenant_kv(request: Request, slug: str) -> Response:
        session = session_of(request)
        return page(request, session, "_tenant_kv.html", fragment=True, **await kv_context(request, session, slug))

    @app.post("/tenants/{slug}/keys")
    async def create_key(request: Request, slug: str) -> Response:
        session, form = await _posted(request)
        try:
            created = await ask(request, session, "POST", f"/tenants/{_q(slug)}/keys",
                                json={"name": form.get("name", "").strip()[:128]})
            context = await tenant_context(request, session, slug)
        except ApiFailure as exc:
            return back(session, f"/tenants/{_q(slug)}", "error", f"Key not created: {exc}")
        # The secret is in this response only: not in a redirect, a flash or the session.
        return page(request, session, "tenant.html", status=201, new_key=created, **context)

    @app.post("/tenants/{slug}/keys/{key_id}/revoke")
    async def revoke_key(request: Request, slug: str, key_id: int) -> Response:
        session, _form = await _posted(request)
        try:
            await ask(request, session, "POST", f"/tenants/{_q(slug)}/keys/{key_id}/revoke")
        except ApiFailure as exc:
            if exc.status in (403, 404):  # not this credential's tenant or key: the API's refusal, as is
                return failed(request, session, exc)
            return back(session, f"/tenants/{_q(slug)}", "error", f"Key not revoked: {exc}")
        return back(session, f"/tenants/{_q(slug)}", "ok", f"Key {key_id} revoked.")

    # --- pools ---------------------------------------------------------------------------

    @app.get("/pools", response_class=HTMLResponse)
    async def pools(request: Request) -> Response:
        session = session_of(request)
        listing, error = await maybe(request, session, "/pools", limit=500)
        if error is not None:
            return failed(request, session, error)
        rows = []
        for pool in listing["items"]:
            kv, _ = await maybe(request, session, f"/pools/{_q(pool['name'])}/kv")
            guard, _ = await maybe(request, session, f"/pools/{_q(pool['name'])}/slo/state")
            rows.append({"pool": pool, "kv": kv, "guard": guard})
        return page(request, session, "pools.html", rows=rows)

    async def pool_live(request: Request, session: ConsoleSession, name: str) -> dict[str, Any]:
        ref = _q(name)
        pool = await ask(request, session, "GET", f"/pools/{ref}")
        kv, kv_error = await maybe(request, session, f"/pools/{ref}/kv")
        live = {r["name"]: r for r in (kv or {}).get("replicas", [])}
        chart = charts.miss_ratio_chart([(name, "pool", kv["mrc"])], title=f"Miss-ratio curve of pool {name}") \
            if kv is not None else None
        return {"pool": pool, "kv": kv, "kv_error": kv_error, "live": live, "kv_chart": chart}

    @app.get("/pools/{name}", response_class=HTMLResponse)
    async def pool(request: Request, name: str) -> Response:
        session = session_of(request)
        try:
            context = await pool_live(request, session, name)
        except ApiFailure as exc:
            return failed(request, session, exc)
        ref = _q(name)
        budget, budget_error = await maybe(request, session, f"/pools/{ref}/slo")
        guard, guard_error = await maybe(request, session, f"/pools/{ref}/slo/state")
        trips, _ = await maybe(request, session, "/audit", entity_type="pool_slo",
                               entity_id=str(context["pool"]["id"]), limit=20)
        captures, captures_error = await maybe(request, session, f"/pools/{ref}/captures")
        return page(request, session, "pool.html", budget=budget, budget_error=budget_error, guard=guard,
                    guard_error=guard_error, trips=(trips or {}).get("items", []), captures=captures or [],
                    captures_error=captures_error, **context)

    @app.get("/pools/{name}/live", response_class=HTMLResponse)
    async def pool_live_fragment(request: Request, name: str) -> Response:
        session = session_of(request)
        try:
            context = await pool_live(request, session, name)
        except ApiFailure as exc:
            return failed(request, session, exc)
        return page(request, session, "_pool_live.html", fragment=True, **context)

    @app.post("/pools/{name}/replicas/{replica}/state")
    async def replica_state(request: Request, name: str, replica: str) -> Response:
        session, form = await _posted(request)
        state = form.get("state", "")
        try:
            version = int(form.get("version", ""))
        except ValueError:
            return back(session, f"/pools/{_q(name)}", "error", "version must be a number")
        try:
            await ask(request, session, "PATCH", f"/pools/{_q(name)}/replicas/{_q(replica)}",
                      json={"version": version, "state": state})
        except ApiFailure as exc:
            return back(session, f"/pools/{_q(name)}", "error", f"Replica {replica} unchanged: {exc}")
        return back(session, f"/pools/{_q(name)}", "ok", f"Replica {replica} is now {state}.")

    @app.post("/pools/{name}/slo/restore")
    async def slo_restore(request: Request, name: str) -> Response:
        session, _form = await _posted(request)
        try:
            await ask(request, session, "POST", f"/pools/{_q(name)}/slo/restore")
        except ApiFailure as exc:
            return back(session, f"/pools/{_q(name)}", "error", f"Not restored: {exc}")
        return back(session, f"/pools/{_q(name)}", "ok", "Host tier restored.")

    @app.post("/pools/{name}/captures")
    async def start_capture(request: Request, name: str) -> Response:
        session, form = await _posted(request)
        body: dict[str, Any] = {}
        try:
            if form.get("sample_rate", "").strip():
                body["sample_rate"] = float(form["sample_rate"])
        except ValueError:
            return back(session, f"/pools/{_q(name)}", "error", "sample rate must be a number")
        if form.get("tenant", "").strip():
            body["tenant"] = form["tenant"].strip()
        try:
            created = await ask(request, session, "POST", f"/pools/{_q(name)}/captures", json=body)
        except ApiFailure as exc:
            return back(session, f"/pools/{_q(name)}", "error", f"Capture not started: {exc}")
        return back(session, f"/pools/{_q(name)}", "ok", f"Capture {created['id']} started.")

    @app.post("/pools/{name}/captures/{capture_id}/stop")
    async def stop_capture(request: Request, name: str, capture_id: str) -> Response:
        session, _form = await _posted(request)
        try:
            await ask(request, session, "POST", f"/pools/{_q(name)}/captures/{_q(capture_id)}/stop")
        except ApiFailure as exc:
            return back(session, f"/pools/{_q(name)}", "error", f"Capture not stopped: {exc}")
        return back(session, f"/pools/{_q(name)}", "ok", f"Capture {capture_id} stopped.")

    return app
