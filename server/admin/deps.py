"""Dependencies of the admin routes, as ``Annotated`` aliases.

Everything comes from ``request.app.state`` (set by ``create_admin_app``): no globals,
so tests build as many apps as they like side by side.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from server.admin.oidc import looks_like_jwt
from server.admin.permissions import authorize
from server.errors import ApiError
from server.settings import Settings
from tenants import admin_credentials as credentials_service
from tenants.admin_credentials import AdminIdentity
from tenants.models import Tenant

log = logging.getLogger("kvgate.admin")
MAX_OFFSET = 2**31 - 1
_bearer = HTTPBearer(auto_error=False, description="a bootstrap token (KVGATE_ADMIN_TOKENS), an admin credential "
                     "kva_<prefix>_<secret>, or an OIDC token when configured")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        # Why guarded: close() rolls back, and this runs after the response has started.
        # If the database vanished in between, raising here made uvicorn drop the
        # connection without an answer (the handler's commit, if any, stands).
        try:
            session.close()
        except SQLAlchemyError:
            log.warning("database gone while closing an admin session; connection discarded")
            with contextlib.suppress(SQLAlchemyError):
                session.invalidate()


def get_now(request: Request) -> datetime:
    return request.app.state.clock()


def _bootstrap_actor(request: Request, presented: bytes) -> str | None:
    """The actor of a matching ``KVGATE_ADMIN_TOKENS`` token. Every configured token is
    compared (``hmac.compare_digest``), so timing does not say which one matched or how many
    there are."""
    actor = None
    for candidate_actor, token in request.app.state.admin_credentials:
        if hmac.compare_digest(presented, token.encode()) and presented:
            actor = candidate_actor
    return actor


def _oidc_identity(request: Request, token: str, session: Session) -> AdminIdentity | None:
    verifier = getattr(request.app.state, "oidc", None)
    if verifier is None or not looks_like_jwt(token):
        return None
    claims = verifier.verify(token)
    if claims is None:
        return None
    if claims.tenants is None:
        return AdminIdentity(name=claims.name, role=claims.role, tenant_ids=None, tenants=None, actor=claims.name)
    # A scope of no tenant (no claim sent) is still a scope: empty, never None (= every tenant).
    pairs = session.execute(select(Tenant.id, Tenant.slug).where(Tenant.slug.in_(claims.tenants))
                            .order_by(Tenant.slug)).all() if claims.tenants else []
    return AdminIdentity(name=claims.name, role=claims.role, tenant_ids=frozenset(p.id for p in pairs),
                         tenants=tuple(p.slug for p in pairs), actor=claims.name)


def authenticate(request: Request, presented: str, session: Session, settings: Settings, now: datetime
                 ) -> AdminIdentity | None:
    """Who presents ``presented``: a bootstrap token (platform-admin), an admin credential
    ``kva_...`` (read from the registry on every request: revocation and expiry hold at once
    on every replica), or an OIDC token when configured."""
    actor = _bootstrap_actor(request, presented.encode("utf-8", "surrogatepass"))
    if actor is not None:
        return AdminIdentity(name=actor, role="platform-admin", tenant_ids=None, tenants=None, actor=actor)
    if presented.startswith(f"{credentials_service.SCHEME}_"):
        return credentials_service.authenticate_credential(
            session, plaintext=presented, pepper=settings.effective_key_pepper(), now=now)
    return _oidc_identity(request, presented, session)


def current_identity(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    session: Annotated[Session, Depends(get_session)],
    settings: Annotated[Settings, Depends(get_settings)],
    now: Annotated[datetime, Depends(get_now)],
) -> AdminIdentity:
    """The authenticated caller, allowed by the route's rule (``server.admin.permissions``);
    else 401 (no valid credential), 403 (role/scope) or 404 (a tenant outside its scope)."""
    identity = None
    if credentials is not None:
        identity = authenticate(request, credentials.credentials, session, settings, now)
    if identity is None:
        raise ApiError(
            401, "unauthorized", "a valid admin bearer token is required", headers={"WWW-Authenticate": "Bearer"}
        )
    route = request.scope.get("route")
    authorize(identity, method=request.method, path=getattr(route, "path", ""), path_params=request.path_params,
              session=session)
    return identity


def require_admin(identity: Annotated[AdminIdentity, Depends(current_identity)]) -> str:
    """The caller's audit actor (``admin:<name>``, ``cred:<id>:<name>``, ``oidc:<subject>``)."""
    return identity.actor


@dataclass(frozen=True, slots=True)
class PageParams:
    limit: int
    offset: int


def page_params(
    limit: Annotated[int, Query(ge=1, le=500, description="page size, 1..500")] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="rows to skip")] = 0,
) -> PageParams:
    return PageParams(limit=limit, offset=offset)


def get_engine_reports(request: Request):
    """``pool name -> CapacityCheck | None`` from the gateway's pool monitor; a bare admin app has none."""
    return getattr(request.app.state, "engine_reports", None) or (lambda _name: None)


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
NowDep = Annotated[datetime, Depends(get_now)]
AdminActor = Annotated[str, Depends(require_admin)]
IdentityDep = Annotated[AdminIdentity, Depends(current_identity)]
Paging = Annotated[PageParams, Depends(page_params)]
EngineReportsDep = Annotated[object, Depends(get_engine_reports)]
