"""What every console page shares: headers, role checks, the session and API helpers, paging.

:class:`Console` holds one console app's collaborators (the parent app whose ``/admin/v1``
it calls, the session store, the templates) and the helpers its handlers use; the handlers
themselves are in ``pages.py`` (sign-in, errors), ``tenant_pages.py`` and ``pool_pages.py``.

Invariants: every POST handler starts with :meth:`Console.posted` (session + CSRF +
origin); no handler reaches the registry except through :class:`AdminApi`; a 401 from the
API ends the session (the credential was revoked or expired).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from fastapi import Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from server.admin.console.api import AdminApi, ApiFailure
from server.admin.console.sessions import COOKIE, ConsoleSession, SessionStore
from server.admin.permissions import RULES

CONSOLE_PREFIX = "/console"

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
STATIC_CACHE = "public, max-age=3600"  # htmx and the stylesheet; pages stay no-store

# What each role may do, to hide the controls it cannot use: the admin API's own rules
# (server/admin/permissions.py), read from its table. The API enforces; this only hides.
CAN: dict[str, frozenset[str]] = {
    "tenant.create": RULES[("POST", "/tenants")].roles,
    "key.read": RULES[("GET", "/tenants/{ref}/keys")].roles,
    "key.write": RULES[("POST", "/tenants/{ref}/keys")].roles,
    "pools.read": RULES[("GET", "/pools")].roles,
    "replica.state": RULES[("PATCH", "/pools/{ref}/replicas/{name}")].roles,
    "slo.restore": RULES[("POST", "/pools/{ref}/slo/restore")].roles,
    "capture.write": RULES[("POST", "/pools/{ref}/captures")].roles,
}
UNSCOPED_ONLY = frozenset({"pools.read"})  # whatever the role, not for a session scoped to tenants
REPLICA_STATES = ("active", "draining", "disabled")
PAGE_SIZE, MAX_PAGE = 50, 500  # MAX_PAGE: the admin API's largest page
MAX_OFFSET = 2**31 - 1


class SignInRequired(Exception):
    """No live session (or the API no longer accepts its credential): go to the sign-in page."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message)
        self.message = message


class Refused(Exception):
    """A POST without a valid CSRF token or from another origin: 403, nothing done."""


def secure(request: Request) -> bool:
    return request.url.scheme == "https"


def url(path: str) -> str:
    return CONSOLE_PREFIX + path


def q(part: str) -> str:
    return quote(part, safe="")


def number(text: str, kind: type[int] | type[float]) -> int | float:
    """A form's number; ValueError unless it is one JSON can carry (no nan, inf or 1e999)."""
    value = kind(text.strip())
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def pager(path: str, *, offset: int, limit: int, total: int, shown: int, **params: str) -> dict[str, Any]:
    """Where this page sits among ``total`` rows, and the links to the pages around it."""
    extra = {k: v for k, v in params.items() if v}

    def link(at: int) -> str:
        return url(path) + "?" + urlencode({"offset": at, "limit": limit, **extra})

    return {"first": offset + 1 if shown else 0, "last": offset + shown, "total": total,
            "prev": link(max(0, offset - limit)) if offset > 0 else None,
            "next": link(offset + limit) if offset + limit < total else None}


def is_poll(request: Request) -> bool:
    """A live panel's htmx poll (the console's only htmx requests are those GETs): not the user's doing."""
    return request.method == "GET" and request.headers.get("HX-Request") == "true"


class Console:
    def __init__(self, *, api_app: Any, sessions: SessionStore, templates: Jinja2Templates) -> None:
        self.api_app, self.sessions, self.templates = api_app, sessions, templates

    def session_of(self, request: Request) -> ConsoleSession:
        # A poll reads the session without touching it, so an unattended open page goes idle too.
        session = self.sessions.get(request.cookies.get(COOKIE), touch=not is_poll(request))
        if session is None:
            raise SignInRequired()
        return session

    def can(self, session: ConsoleSession, action: str) -> bool:
        if action in UNSCOPED_ONLY and session.tenants is not None:  # the API refuses pools to a scoped caller
            return False
        return session.role in CAN[action]

    async def posted(self, request: Request) -> tuple[ConsoleSession, dict[str, str]]:
        """The session and form of a POST, after the origin and CSRF checks."""
        self.same_origin(request)
        session = self.session_of(request)
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        if not session.check_csrf(form.get("csrf") or request.headers.get("X-CSRF-Token")):
            raise Refused("missing or invalid CSRF token: reload the page and try again")
        return session, form

    @staticmethod
    def same_origin(request: Request) -> None:
        # Defence in depth beside the token: a browser names the page's origin on a POST.
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            parts = urlsplit(origin)
            if parts.netloc != request.headers.get("host", ""):
                raise Refused("cross-origin form refused")

    async def ask(self, request: Request, session: ConsoleSession, method: str, path: str, **kw: Any) -> Any:
        """An API call; a 401 ends the session (the credential was revoked or expired)."""
        api = AdminApi(self.api_app, session.credential)
        try:
            if method == "GET":
                return await api.get(path, **kw)
            return await api.call(method, path, **kw)
        except ApiFailure as exc:
            if exc.status == 401:
                self.sessions.drop(request.cookies.get(COOKIE))
                raise SignInRequired("the admin API no longer accepts this credential") from exc
            raise

    async def maybe(self, request: Request, session: ConsoleSession, path: str,
                    **kw: Any) -> tuple[Any, ApiFailure | None]:
        try:
            return await self.ask(request, session, "GET", path, **kw), None
        except ApiFailure as exc:
            return None, exc

    async def every(self, request: Request, session: ConsoleSession, path: str, *, cap: int = 5_000) -> list[Any]:
        """Every item of a paged listing (the first ``cap``), for a form's choices; [] if refused."""
        items: list[Any] = []
        while len(items) < cap:
            listing, error = await self.maybe(request, session, path, limit=MAX_PAGE, offset=len(items))
            if error is not None or not listing["items"]:
                break
            items += listing["items"]
            if len(items) >= listing["total"]:
                break
        return items[:cap]

    def page(self, request: Request, session: ConsoleSession | None, name: str, status: int = 200, *,
             fragment: bool = False, **context: Any) -> Response:
        # A polled fragment must not consume the flash messages meant for the next full page.
        ctx = {"me": session, "flashes": session.take_flashes() if session and not fragment else [],
               "can": (lambda action: session is not None and self.can(session, action)), **context}
        return self.templates.TemplateResponse(request, name, ctx, status_code=status)

    @staticmethod
    def back(session: ConsoleSession, path: str, kind: str | None = None, message: str | None = None) -> Response:
        if kind and message:
            session.flash(kind, message)
        return RedirectResponse(url(path), status_code=303)

    def failed(self, request: Request, session: ConsoleSession | None, exc: ApiFailure) -> Response:
        code = exc.status if exc.status >= 400 else 502
        return self.error(request, session, code, str(exc))

    def error(self, request: Request, session: ConsoleSession | None, code: int, message: str,
              headers: dict[str, str] | None = None) -> Response:
        response = self.page(request, session, "error.html", status=code, code=code, message=message)
        for name, value in (headers or {}).items():
            response.headers[name] = value
        return response


def form_error(what: str, status: int, message: str, *, field: str | None = None,
               detail: str | None = None) -> dict[str, Any]:
    """A refused form's reason, shown above the form and, when it names one of the form's
    fields, next to that field; ``status`` is the answer's (the API's when it refused)."""
    return {"field": field, "message": message, "summary": f"{what}: {detail or message}", "status": status}


def api_form_error(what: str, exc: ApiFailure, fields: tuple[str, ...]) -> dict[str, Any]:
    return form_error(what, exc.status if exc.status >= 400 else 502, exc.message,
                      field=exc.field if exc.field in fields else None, detail=str(exc))
