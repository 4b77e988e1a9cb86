"""The admin API's single error shape and the handlers that produce it.

Every admin error body is ``{"error": {"code": str, "message": str, "field": str | null}}``:
registry errors keep their code/field, request validation is 422 naming the first bad
field, an unreachable database is 503 ``database_unavailable``, and nothing a client
sends produces a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tenants.errors import RegistryError

log = logging.getLogger("kvgate.admin")

STATUS_BY_KIND = {"invalid": 422, "not_found": 404, "forbidden": 403, "conflict": 409}
CODE_BY_STATUS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_request",
    503: "unavailable",
}


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.headers = status, code, message, field, headers


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field}}


def error_response(
    status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(code, message, field), status_code=status, headers=headers)


def _field_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or ("body" if loc and loc[0] == "body" else None)


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)


async def _on_registry_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RegistryError)
    return error_response(STATUS_BY_KIND.get(exc.kind, 422), exc.code, exc.message, exc.field)


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    field = _field_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return error_response(422, "invalid_json", "the request body is not valid JSON", "body")
    code = "invalid_value"
    message = str(first.get("msg", "invalid request"))
    if field:
        message = f"{field}: {message}"
    return error_response(422, code, message, field)


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = CODE_BY_STATUS.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(exc.status_code, code, str(exc.detail), None, getattr(exc, "headers", None))


async def _on_database_error(_request: Request, exc: Exception) -> JSONResponse:
    # Why 503: the registry is a dependency; clients and load balancers should retry, not report a bug.
    log.warning("database unavailable: %s", type(exc).__name__)
    return error_response(
        503,
        "database_unavailable",
        "the tenant registry database is unavailable; retry later",
        None,
        {"Retry-After": "5"},
    )


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected admin error", exc_info=exc)
    return error_response(500, "internal_error", "internal error", None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RegistryError, _on_registry_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for exc_type in (OperationalError, InterfaceError, PoolTimeoutError):
        app.add_exception_handler(exc_type, _on_database_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(DBAPIError, _on_dbapi_error)
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_dbapi_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DBAPIError)
    if exc.connection_invalidated:
        return await _on_database_error(request, exc)
    return await _on_unexpected(request, exc)


async def _on_data_error(_request: Request, exc: Exception) -> JSONResponse:
    # The database refused a value (out-of-range number, NUL byte in text): bad input, not a bug.
    return error_response(422, "invalid_value", "a value is not storable (out of range or invalid characters)", None)
