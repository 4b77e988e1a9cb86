"""The tenant admin REST API, a FastAPI sub-application mounted at ``/admin/v1``.

Being its own sub-app gives it its own OpenAPI document (``/admin/v1/openapi.json``),
docs page (``/admin/v1/docs``) and error handlers (the admin error shape), independent
of the OpenAI-style routes the gateway mounts on the parent app.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from server.admin import audit, captures, credentials, keys, kv, pools, retention_classes, slo, tenants
from server.admin.oidc import OidcVerifier
from server.admin.schemas import ERROR_RESPONSES
from server.errors import install_error_handlers
from server.settings import Settings

ADMIN_PREFIX = "/admin/v1"


def create_admin_app(
    *, settings: Settings, session_factory: sessionmaker[Session], clock: Callable[[], datetime]
) -> FastAPI:
    app = FastAPI(
        title="kvgate admin API",
        version="1",
        description="Tenant registry: pools, retention classes, tenants, API keys, audit, usage; admin "
        "credentials with roles (platform-admin, operator, tenant-admin, viewer).",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.clock = clock
    # Resolved once: actor ids and tokens; the tokens never leave app.state.
    app.state.admin_credentials = tuple(settings.admin_credentials())
    app.state.oidc = OidcVerifier(settings) if settings.oidc_enabled else None
    install_error_handlers(app)
    for module in (credentials, pools, slo, captures, kv, retention_classes, tenants, keys, audit):
        app.include_router(module.router, responses=ERROR_RESPONSES)
    return app
