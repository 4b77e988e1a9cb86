"""Installs the serving gateway into the app built by ``server.app.create_app``.

Adds the OpenAI-compatible routes and the Anthropic Messages routes, each with its own
error shape (by path: under ``/v1/messages`` errors are Anthropic's, elsewhere OpenAI's), ``/metrics``, ``/readyz``, a
request-body size limit, and the gateway's background loops in the app's lifespan.
Every answer of ``/v1/...`` (errors and streams included) carries its request id in the
dialect's header (:class:`RequestIds`).
The admin API stays a mounted sub-app with its own error shape; after every successful
admin mutation the auth cache is cleared, so a revoked key or a suspended tenant is
refused by this process at once.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import CODE_BY_STATUS as ADMIN_CODES
from server.errors import error_response as admin_error_response
from server.gateway.api.streaming import CLIENT_RECEIVE
from server.gateway.context import REQUEST_ID
from server.gateway.drain import SERVING_PREFIX, InFlight
from server.gateway.kv_view import KvView
from server.gateway.errors import ServingError, error_response, validation_error
from server.gateway.fast_path import HotRoutes
from server.gateway.replicas.pool_monitor import TenantQuota
from server.gateway.api import messages_render
from server.gateway.messages_routes import PATH_PREFIX as MESSAGES_PREFIX
from server.gateway.messages_routes import router as messages_router
from server.gateway.routes import router
from server.gateway.responses_routes import router as responses_router
from server.gateway.services import GatewayServices
from tenants.auth import list_active_tenants_by_pool, list_pool_snapshots
from tenants.common import id_value
from tenants.snapshots import PoolSnapshot

MAX_BODY_BYTES = 4 * 1024 * 1024
ADMIN_PREFIX = "/admin/"
CLIENT_REQUEST_HEADER = b"x-client-request-id"  # a client's own id for its request (OpenAI's name), echoed
CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")  # fullmatch: no "$" that lets a trailing newline in


def registry_pools_and_tenants(session_factory):
    """``pools_and_tenants`` for :class:`PoolMonitor`, read from the registry (sync)."""

    def read() -> list[tuple[PoolSnapshot, list[TenantQuota]]]:
        with session_factory() as session:
            by_pool = list_active_tenants_by_pool(session)
            return [(snap, [TenantQuota(t.id, t.slug, t.kv_quota_fraction) for t in by_pool.get(snap.id, ())])
                    for snap in list_pool_snapshots(session)]

    return read


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, before any parsing."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    def _reject(self, path: str) -> Response:
        message = f"request body is larger than {self.limit} bytes"
        if path.startswith(ADMIN_PREFIX):
            body = {"error": {"code": "payload_too_large", "message": message, "field": None}}
            return JSONResponse(body, status_code=413)
        return serving_error_response(path, ServingError(413, "payload_too_large", message))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope["path"])(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(scope["path"])(scope, receive, send)


def _anthropic(path: str) -> bool:
    """Whether ``path`` belongs to the Anthropic Messages dialect (else the OpenAI one)."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def serving_error_response(path: str, exc: ServingError) -> Response:
    """The serving API's error in the shape of the dialect that owns ``path``."""
    if _anthropic(path):
        return messages_render.error_response(exc)
    return error_response(exc)


class RequestIds:
    """Every answer of ``/v1/...`` carries its request id: ``request-id`` under ``/v1/messages``
    (the Anthropic SDK's ``_request_id``), ``x-request-id`` elsewhere (the OpenAI SDK's).

    The id is the server's, always ``req_`` + 24 hex chars from ``secrets``, so it is unique (a
    support lookup or a log line names one request whoever sent it). A client's own id travels
    beside it, as OpenAI takes it: ``x-client-request-id``, echoed on the answer when it
    fullmatches ``[A-Za-z0-9._:-]{1,128}`` and dropped otherwise (nothing unvalidated reaches a
    response header). While the request runs the server's id is
    :data:`~server.gateway.context.REQUEST_ID`, for the log lines about it.

    Outermost of the user middleware, so whatever answers (the hot routes' fast path, a route,
    an exception handler, the body limit's 413, the drain's 503) passes the stamp: headers
    added to ``http.response.start``, a stream's included. An unhandled exception before the
    answer started is answered here, stamped, as the dialect's error (500 ``internal_error``,
    naming the request id), and then raised on, so the server still logs it; Starlette's
    ServerErrorMiddleware, outside all user middleware, sees the answer started and sends
    nothing of its own (its plain-text 500 would carry neither the stamp nor the dialect).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        if not path.startswith(SERVING_PREFIX):
            return await self.app(scope, receive, send)
        value = b"req_" + secrets.token_hex(12).encode()
        stamps = [(b"request-id" if _anthropic(path) else b"x-request-id", value)]
        for key, sent in scope["headers"]:
            if key == CLIENT_REQUEST_HEADER:
                if CLIENT_REQUEST_ID.fullmatch(sent):
                    stamps.append((CLIENT_REQUEST_HEADER, sent))
                break

        started = False

        async def stamped(message):
            nonlocal started
            if message["type"] == "http.response.start":  # a new list: never grow one the app may share
                started = True
                message["headers"] = [*message.get("headers", ()), *stamps]
            await send(message)

        request_id = value.decode()
        token = REQUEST_ID.set(request_id)
        # The request core watches the client's connection while it waits for the engine, before
        # any answer has started (a client gone then cancels the engine call, never retried).
        receiving = CLIENT_RECEIVE.set(receive)
        try:
            await self.app(scope, receive, stamped)
        except Exception:
            if not started:
                crash = ServingError(500, "internal_error",
                                     f"the gateway failed on this request; quote its id {request_id} when reporting it")
                await serving_error_response(path, crash)(scope, receive, stamped)
            raise
        finally:
            CLIENT_RECEIVE.reset(receiving)
            REQUEST_ID.reset(token)


class _TooLarge(StarletteHTTPException):
    """A body past the limit, found while it is read (chunked: no Content-Length to refuse up front).

    An ``HTTPException`` so that FastAPI, reading the body for a route, lets it through to the
    app's handler for it (413 in the API's shape) instead of taking it for an unparsable body (400);
    ``BodyLimit`` answers it itself where nothing else did (a middleware that read the body)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


def _tenant_of(path: str) -> str | None:
    """``ref`` of ``/admin/v1/tenants/<ref>[/...]``, else None; an id as the registry reads it
    (``01`` is tenant 1), so the auth cache forgets the tenant the write changed. A number no id
    can be (of any length: no ``int()`` of it) stays as written, naming no tenant."""
    parts = path.split("/")
    if len(parts) >= 5 and parts[1:4] == ["admin", "v1", "tenants"] and parts[4]:
        ref = parts[4]  # ASGI paths arrive percent-decoded
        number = id_value(ref)
        return str(number) if number is not None else ref
    return None


class AdminMutationHook:
    """Clears the auth cache after a successful non-GET admin request.

    A write under ``/admin/v1/tenants/<ref>/...`` clears only that tenant's entries;
    anything else (pools, classes, tenant creation) clears them all.
    """

    def __init__(self, app, services: GatewayServices) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(ADMIN_PREFIX) or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        async def watch(message):
            # Why before forwarding: the client may send its next request the moment it
            # sees this response; the change is committed by then, the cache must be too.
            if message["type"] == "http.response.start" and 200 <= message["status"] < 300:
                self.services.auth.clear(_tenant_of(scope["path"]))
            await send(message)

        await self.app(scope, receive, watch)


def install_gateway(app: FastAPI, services: GatewayServices) -> FastAPI:
    app.state.gateway = services
    admin_app = getattr(app.state, "admin_app", None)
    if admin_app is not None:
        # The admin API shows each pool's engine-reported capacity from the monitor's latest poll,
        # and /pools/{ref}/slo/state and /restore reach this process's SLO guards (server/admin/slo.py).
        admin_app.state.engine_reports = services.monitor.capacity
        admin_app.state.slo_guard = services.slo_guards
        # /tenants/{ref}/kv and /pools/{ref}/kv read this process's KV figures (server/admin/kv.py).
        admin_app.state.kv_view = KvView(monitor=services.monitor, metrics=services.metrics,
                                         routing=services.routing, curves=services.curves)
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(responses_router)

    async def on_validation(request: Request, exc: RequestValidationError):
        return serving_error_response(request.url.path, validation_error(exc))

    async def on_serving_error(request: Request, exc: ServingError):
        return serving_error_response(request.url.path, exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith(ADMIN_PREFIX):
            # A path the admin mount cannot match (its pattern stops at a newline, e.g.
            # /admin/v1/tenants/%0A/keys) lands here: it is still an admin API error.
            code = ADMIN_CODES.get(exc.status_code, f"http_{exc.status_code}")
            return admin_error_response(exc.status_code, code, str(exc.detail), None, dict(exc.headers or {}) or None)
        # FastAPI answers undecodable bodies, unknown routes and wrong methods with
        # HTTPException; give them the serving API's error shape too.
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large"}.get(exc.status_code, "http_error")
        return serving_error_response(request.url.path, ServingError(exc.status_code, code, str(exc.detail),
                                                                     headers=dict(exc.headers or {})))

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ServingError, on_serving_error)
    app.add_exception_handler(RequestValidationError, on_validation)

    metrics_token = getattr(app.state.settings, "metrics_token", None)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        # Why a token: the series carry every tenant's slug, traffic and KV blocks; on the
        # public port any API-key holder could watch the others (tests/reliability).
        if metrics_token:
            presented = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(presented, f"Bearer {metrics_token}".encode()):
                return error_response(ServingError(401, "invalid_metrics_token",
                                                   "/metrics needs 'Authorization: Bearer <KVGATE_METRICS_TOKEN>'"))
        return Response(generate_latest(services.registry), media_type=CONTENT_TYPE_LATEST)

    ping_timeout_s = 2.0  # /readyz's registry ping (probes commonly give up after a few seconds)
    ping_flight: list[asyncio.Future] = []  # the registry ping in progress (at most one)

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        checks: dict[str, str] = {}
        session_factory = app.state.session_factory

        def ping() -> list:
            with session_factory() as session:
                session.execute(text("SELECT 1"))
                return list_pool_snapshots(session)

        # Bounded: a registry that stops answering (no error, no reset) must make this answer
        # 503 within ping_timeout_s, not hang the probe. The ping's worker thread
        # cannot be interrupted: probes that come while it is still stuck wait for that one
        # (within their own timeout) instead of stranding one thread each.
        if not ping_flight or ping_flight[0].done():
            ping_flight[:] = [asyncio.ensure_future(anyio.to_thread.run_sync(ping))]
            ping_flight[0].add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            with anyio.fail_after(ping_timeout_s):
                pools = await asyncio.shield(ping_flight[0])
            checks["registry"] = "ok"
        except Exception as exc:  # noqa: BLE001 - any failure (a timeout included) means not ready
            checks["registry"] = f"unavailable: {type(exc).__name__}"
            pools = list(services.engines.pools.values())
        # Ready while this gateway can serve at all: its registry answers and at least one pool's
        # engine does. A pool without an answering engine is reported, not disqualifying: every
        # gateway pod sees the same pools, so one pool still loading its engine (or removed and
        # not yet pruned) would otherwise take every pod out of its Service and stop the pools
        # that do serve; that pool's requests get 503 ``engine_unavailable`` instead.
        answering = await asyncio.gather(*(services.routing.ready(pool) for pool in pools))
        for pool, ready in zip(pools, answering, strict=True):
            checks[f"pool:{pool.name}"] = "ok" if ready else "unavailable"
        ok = checks["registry"] == "ok" and (not pools or any(answering)) and not services.draining
        return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a):
            services.start()
            try:
                yield
            finally:
                await services.stop()

    app.router.lifespan_context = lifespan
    # Innermost of the user middleware (the first added): the limits, the in-flight count and
    # the server-error middleware wrap the hot routes' fast path as they wrap the routes.
    app.add_middleware(HotRoutes, services=services, exception_handlers={
        StarletteHTTPException: on_http_error, ServingError: on_serving_error, RequestValidationError: on_validation})
    app.add_middleware(AdminMutationHook, services=services)
    app.add_middleware(BodyLimit)
    app.add_middleware(InFlight, services=services)
    app.add_middleware(RequestIds)  # outermost: every answer of /v1, whoever renders it, carries the id
    return app


