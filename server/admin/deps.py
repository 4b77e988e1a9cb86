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
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from server.errors import ApiError
from server.settings import Settings

log = logging.getLogger("kvgate.admin")
MAX_OFFSET = 2**31 - 1
_bearer = HTTPBearer(auto_error=False, description="an admin token from KVGATE_ADMIN_TOKENS")


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


def require_admin(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The caller's actor id, if its bearer token matches a configured admin token.

    Every configured token is compared (``hmac.compare_digest``), so timing does not say
    which one matched or how many there are.
    """
    presented = credentials.credentials.encode() if credentials is not None else b""
    actor = None
    for candidate_actor, token in request.app.state.admin_credentials:
        if hmac.compare_digest(presented, token.encode()) and credentials is not None:
            actor = candidate_actor
    if actor is None:
        raise ApiError(
            401, "unauthorized", "a valid admin bearer token is required", headers={"WWW-Authenticate": "Bearer"}
        )
    return actor


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
Paging = Annotated[PageParams, Depends(page_params)]
EngineReportsDep = Annotated[object, Depends(get_engine_reports)]
