"""The console's only way to the registry: the admin API, called with the user's credential.

Calls go in process through ``httpx.ASGITransport`` to the parent app's ``/admin/v1``
mount (not to the admin sub-app directly), so every call passes the same middleware a
network client does: the body limit and the gateway's auth-cache hook that makes a key
revoked from the console refused by this process at once. There is no second code path:
validation, role checks, audit and errors are the API's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from server.admin import ADMIN_PREFIX

# Only the ASGI transport reads it; no socket is opened and no name is resolved.
_BASE = "http://kvgate.console" + ADMIN_PREFIX


@dataclass(frozen=True, slots=True)
class ApiFailure(Exception):
    """The admin API refused or failed a call: its status and its error body's code/message/field."""

    status: int
    code: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        where = f" ({self.field})" if self.field else ""
        return f"{self.message}{where} [{self.status} {self.code}]"


class AdminApi:
    """One user's view of the admin API (``credential`` is their bearer token)."""

    def __init__(self, app: Any, credential: str) -> None:
        self._app = app
        # A header carries ASCII only: any other credential is refused here, as the API would.
        self._valid = credential.isascii() and credential.isprintable()
        self._headers = {"Authorization": f"Bearer {credential}"} if self._valid else {}

    async def call(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        """The decoded JSON body of a 2xx answer (None for 204); :class:`ApiFailure` otherwise."""
        if not self._valid:
            raise ApiFailure(401, "unauthorized", "a credential is printable ASCII")
        transport = httpx.ASGITransport(app=self._app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=_BASE, headers=self._headers) as client:
            response = await client.request(method, path, json=json, params=params)
        if response.status_code == 204:
            return None
        try:
            body = response.json()
        except ValueError:
            body = None
        if 200 <= response.status_code < 300:
            return body
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            raise ApiFailure(response.status_code, str(error.get("code")), str(error.get("message")), error.get("field"))
        raise ApiFailure(response.status_code, f"http_{response.status_code}", response.text[:200] or "no body")

    async def get(self, path: str, **params: Any) -> Any:
        return await self.call("GET", path, params={k: v for k, v in params.items() if v is not None} or None)

    async def post(self, path: str, json: Any = None) -> Any:
        return await self.call("POST", path, json=json)

    async def patch(self, path: str, json: Any) -> Any:
        return await self.call("PATCH", path, json=json)

    async def whoami(self) -> dict[str, Any]:
        """``{name, role, tenants}``. Until the admin API has ``/whoami`` (404), a credential the
        API accepts is a bootstrap token from KVGATE_ADMIN_TOKENS: a platform admin."""
        try:
            return await self.get("/whoami")
        except ApiFailure as exc:
            if exc.status != 404:
                raise
        await self.get("/pools", limit=1)  # 401 here: not a credential at all
        return {"name": "bootstrap", "role": "platform-admin", "tenants": None}
