"""The console app: sign-in, errors, headers; the tenant and pool pages are in their own modules.

Thin handlers: read the session, call the admin API (``api.py``) with its credential,
render a template. Writes are plain HTML forms (POST, CSRF token in a hidden field) that
redirect back (303) with a flash message, except key creation, whose answer is the page
that shows the new secret once, and a refused form, which comes back filled in with the
API's reason and status. htmx only polls the live panels (GET fragments).

Errors stay console pages: the console's own 404s and 422s (``HTTPException``,
``RequestValidationError``) and any unexpected exception render ``error.html`` with the
security headers. These handlers belong to this sub-app, so they see only ``/console``
requests; the admin API and ``/v1`` keep their JSON error shapes.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException

from server.admin.console import pool_pages, tenant_pages
from server.admin.console.api import AdminApi, ApiFailure
from server.admin.console.sessions import COOKIE, PRE_COOKIE, SessionStore, SignInThrottle
from server.admin.console.web import (
    CAN,
    CONSOLE_PREFIX,
    REPLICA_STATES,
    SECURITY_HEADERS,
    STATIC_CACHE,
    Console,
    Refused,
    SignInRequired,
    q,
    secure,
    url,
)

__all__ = ["CAN", "CONSOLE_PREFIX", "build"]

HERE = Path(__file__).parent
log = logging.getLogger("kvgate.console")


def _field_errors(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path", "header"))
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request"


def num(value: Any) -> Any:
    """A count with thousands separators; an int exactly (a float has 53 bits: 2**53 + 1 would
    show as 2**53), a float to the unit, anything else as it is."""
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if isinstance(value, float) else value


def build(*, api_app: Any, idle_s: float, max_age_s: float) -> FastAPI:
    app = FastAPI(title="kvgate console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sessions = SessionStore(idle_s=idle_s, max_age_s=max_age_s)
    app.state.signin_throttle = SignInThrottle()
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescapes .html
    templates.env.globals.update(base=CONSOLE_PREFIX, q=q, states=REPLICA_STATES)
    templates.env.filters["pct"] = lambda v: "—" if v is None else f"{v * 100:.1f}%"
    templates.env.filters["num"] = num
    templates.env.filters["when"] = lambda v: "—" if not v else str(v).replace("T", " ")[:19]
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    sessions: SessionStore = app.state.sessions
    throttle: SignInThrottle = app.state.signin_throttle
    console = Console(api_app=api_app, sessions=sessions, templates=templates)

    def known_session(request: Request):  # type: ignore[no-untyped-def]
        """For an error page's header: the session, if any, without touching its idle timer."""
        return sessions.get(request.cookies.get(COOKIE), touch=False)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):  # type: ignore[no-untyped-def]
        # Read before routing, which rewrites the scope in place (a mount extends its root_path).
        root, path = request.scope.get("root_path", ""), request.scope["path"]
        static = (path[len(root):] if path.startswith(root) else path).startswith("/static/")
        try:
            response = await call_next(request)
        except Exception:  # the console's own failure: its error page, never a bare 500
            log.exception("console %s %s failed", request.method, request.url.path)
            response = console.error(request, None, 500, "The console failed to answer this request; "
                                                         "the server's log has the details.")
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if static and response.status_code in (200, 304):
            response.headers["Cache-Control"] = STATIC_CACHE
        return response

    @app.exception_handler(SignInRequired)
    async def to_signin(request: Request, exc: SignInRequired) -> Response:
        target = url("/signin") + ("?expired=1" if exc.message else "")
        if request.headers.get("HX-Request"):
            return Response(status_code=204, headers={"HX-Redirect": target})
        response = RedirectResponse(target, status_code=303)
        response.delete_cookie(COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=secure(request))
        return response

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        return console.error(request, None, 403, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = "No console page at this address." if exc.status_code == 404 else str(exc.detail)
        return console.error(request, known_session(request), exc.status_code, message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return console.error(request, known_session(request), 422, f"Invalid request: {_field_errors(exc)}")

    # --- sign-in -------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        session = console.session_of(request)
        return RedirectResponse(url("/pools" if console.can(session, "pools.read") else "/tenants"), status_code=303)

    def signin_page(request: Request, error: str | None, status: int = 200,
                    headers: dict[str, str] | None = None) -> Response:
        token = secrets.token_urlsafe(32)
        response = templates.TemplateResponse(request, "signin.html", {"me": None, "flashes": [], "error": error,
                                                                       "csrf": token}, status_code=status,
                                               headers=headers)
        response.set_cookie(PRE_COOKIE, token, max_age=600, path=CONSOLE_PREFIX, httponly=True, samesite="strict",
                            secure=secure(request))
        return response

    @app.get("/signin", response_class=HTMLResponse)
    async def signin_form(request: Request, expired: int = 0) -> Response:
        return signin_page(request, "Your session ended: sign in again." if expired else None)

    @app.post("/signin")
    async def signin(request: Request) -> Response:
        console.same_origin(request)
        form = await request.form()
        presented, expected = str(form.get("csrf") or ""), request.cookies.get(PRE_COOKIE) or ""
        if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
            raise Refused("missing or invalid sign-in token: reload the sign-in page")
        client = request.client.host if request.client else "unknown"
        wait = throttle.wait_s(client)
        if wait > 0:  # refused before the credential is tried: no guessing at full speed
            return signin_page(request, f"Too many failed sign-ins from this address: try again in {math.ceil(wait)} s.",
                               429, headers={"Retry-After": str(math.ceil(wait))})
        credential = str(form.get("token") or "").strip()
        # A bearer token is printable ASCII: anything else cannot go in an Authorization header.
        if (not credential or len(credential) > 4096 or not credential.isascii() or not credential.isprintable()
                or any(c.isspace() for c in credential)):
            throttle.failed(client)
            return signin_page(request, "Paste an admin credential (a bearer token).", 400)
        try:
            me = await AdminApi(api_app, credential).whoami()
        except ApiFailure as exc:
            if exc.status in (401, 403):
                throttle.failed(client)
                return signin_page(request, "The admin API refused this credential.", 401)
            return signin_page(request, str(exc), 502)
        tenants = me.get("tenants")
        session_id, session = sessions.create(credential=credential, name=str(me.get("name") or "admin"),
                                              role=str(me.get("role") or "viewer"),
                                              tenants=tuple(tenants) if tenants is not None else None)
        response = RedirectResponse(url("/pools" if console.can(session, "pools.read") else "/tenants"), status_code=303)
        response.set_cookie(COOKIE, session_id, path=CONSOLE_PREFIX, httponly=True, samesite="strict",
                            secure=secure(request), max_age=int(max_age_s))
        response.delete_cookie(PRE_COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=secure(request))
        return response

    @app.post("/signout")
    async def signout(request: Request) -> Response:
        await console.posted(request)
        sessions.drop(request.cookies.get(COOKIE))
        response = RedirectResponse(url("/signin"), status_code=303)
        response.delete_cookie(COOKIE, path=CONSOLE_PREFIX, httponly=True, samesite="strict", secure=secure(request))
        return response

    tenant_pages.register(app, console)
    pool_pages.register(app, console)
    return app
