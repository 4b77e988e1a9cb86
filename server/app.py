"""The kvgate HTTP application factory.

``create_app`` builds the parent FastAPI app and mounts the admin API at ``/admin/v1``.
Everything the routes need is injected and kept on ``app.state`` (no module globals),
so the gateway can add its routes and engine clients, and tests can build isolated apps:

    app = create_app(settings, session_factory=factory, clock=lambda: fixed_now)

Invariant: the factory refuses to build an app whose secrets are placeholders unless
``settings.dev`` (``Settings.check_serving_secrets``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from fastapi import FastAPI
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from server.admin import ADMIN_PREFIX, create_admin_app
from server.admin.console import CONSOLE_PREFIX, create_console_app
from server.settings import Settings
from tenants.db import make_engine, make_session_factory


def _utcnow() -> datetime:
    return datetime.now(UTC)


def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    session_factory: sessionmaker[Session] | None = None,
    clock: Callable[[], datetime] = _utcnow,
) -> FastAPI:
    """Build the app. Pass ``session_factory`` (or ``engine``) to share a database; otherwise
    an engine is made from ``settings.database_url`` and disposed at shutdown.

    State: ``app.state.settings``, ``.engine`` (may be None), ``.session_factory``, ``.clock``,
    ``.admin_app`` (the mounted sub-app), ``.console_app`` (the web console at ``/console``).
    """
    settings.check_serving_secrets()
    owned_engine: Engine | None = None
    if session_factory is None:
        if engine is None:
            engine = owned_engine = make_engine(settings.database_url)
        session_factory = make_session_factory(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned_engine is not None:
                owned_engine.dispose()

    app = FastAPI(title="kvgate", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.clock = clock
    admin_app = create_admin_app(settings=settings, session_factory=session_factory, clock=clock)
    app.state.admin_app = admin_app
    app.mount(ADMIN_PREFIX, admin_app)
    # The web console calls the admin API through this app (so through its middleware), never the registry.
    app.state.console_app = create_console_app(api_app=app)
    app.mount(CONSOLE_PREFIX, app.state.console_app)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
