"""OpenAI-style error bodies for the serving API: ``{"error": {message, type, param, code}}``.

``code`` is stable (clients branch on it); ``message`` is for people. A 429 is typed as OpenAI
types it, by the limit its ``param`` names: ``"tokens"`` for tokens_per_minute, else ``"requests"``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "requests", 500: "server_error", 502: "server_error", 503: "service_unavailable",
          504: "timeout_error"}


class ServingError(Exception):
    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = "tokens" if status == 429 and param == "tokens_per_minute" else _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: ServingError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.code, exc.message, exc.param), status_code=exc.status, headers=exc.headers)


def validation_error(exc: RequestValidationError) -> ServingError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ())]
    if loc[:1] in (["body"], ["query"]):  # where the field was sent (body, query string); a param names the field
        loc = loc[1:]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":  # FastAPI's msg is generic; the parser's own reason is in ctx
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return ServingError(400, "invalid_json", f"request body is not valid JSON: {reason}")
    if kind == "extra_forbidden":
        return ServingError(400, "unsupported_parameter", f"unknown or unsupported parameter: {param}", param=param)
    message = first.get("msg", "invalid request")
    return ServingError(400, "invalid_request", f"{param}: {message}" if param else message, param=param)


async def handle_serving_error(_: Request, exc: ServingError) -> JSONResponse:
    return error_response(exc)
