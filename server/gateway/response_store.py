"""The gateway's handle on stored responses (``tenants.responses``): async, per tenant, typed errors.

Every call runs the registry's sync service function in a worker thread (as the auth and
usage paths do) and turns registry errors into the serving API's: not found (missing,
expired, deleted, another tenant's) → 404 ``response_not_found``, except for a
``previous_response_id`` (:meth:`ResponseStore.chain`): OpenAI's 400
``previous_response_not_found`` ("Previous response with id '<id>' not found."), which
clients read as "resend the whole history", for any id that cannot be continued (never
stored, ``store: false``, another tenant's, deleted, expired, or an ancestor gone); a full store → 400
``response_store_full``; a bad page parameter → 400 naming it; the registry database out of
reach (connection refused or lost, no pooled connection in time) → 503
``registry_unavailable`` with ``Retry-After: 1``, as authentication answers. The TTL and the
per-tenant byte cap come from the settings (``responses_ttl_s``, ``responses_max_bytes``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Literal

import anyio
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as SqlTimeoutError

from server.gateway.errors import ServingError
from tenants import responses as stored
from tenants.errors import NotFound, RegistryError

log = logging.getLogger("kvgate.gateway.responses")

DEFAULT_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days
DEFAULT_MAX_BYTES = 64 * 2**20


# What an unreachable registry raises: no connection (refused, dropped: OperationalError,
# InterfaceError) or none free in the pool in time (TimeoutError). Other database errors (a
# constraint, a bad statement) are bugs and stay 500.
UNAVAILABLE = (OperationalError, InterfaceError, SqlTimeoutError)


def _serving(exc: RegistryError) -> ServingError:
    if isinstance(exc, NotFound):
        return ServingError(404, exc.code, exc.message, param=exc.field)
    return ServingError(400, exc.code, exc.message, param=exc.field)


def registry_unavailable() -> ServingError:
    """As authentication answers when the registry cannot be read (server/gateway/auth.py)."""
    return ServingError(503, "registry_unavailable", "the tenant registry is unavailable; retry shortly",
                        headers={"Retry-After": "1"})


@dataclass(frozen=True, slots=True)
class StoredChain:
    """A stored conversation up to one response: every turn's items, oldest first, the id of
    the response it started with (the conversation's routing key) and every response's id,
    oldest first (what a continuation keeps alive as long as itself)."""

    items: list[dict]
    root_id: str
    ids: tuple[str, ...] = ()


class ResponseStore:
    def __init__(self, session_factory, *, ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        if ttl_s <= 0 or max_bytes < 1:
            raise ValueError("responses TTL and byte cap must be positive")
        self._factory = session_factory
        self.ttl = timedelta(seconds=ttl_s)
        self.max_bytes = max_bytes
        self._clock = clock

    async def _call(self, fn, **kwargs):
        def work():
            with self._factory() as session:
                return fn(session, now=self._clock(), **kwargs)

        try:
            return await anyio.to_thread.run_sync(work)
        except RegistryError as exc:
            raise _serving(exc) from exc
        except UNAVAILABLE as exc:
            raise registry_unavailable() from exc

    async def chain(self, *, tenant_id: int, response_id: str) -> StoredChain:
        """``response_id``'s chain: its input and output items, oldest first, its root's id and
        its responses' ids. Any link gone is OpenAI's 400 ``previous_response_not_found`` with
        OpenAI's message (an ancestor gone: a second sentence names it; the id itself gone: the
        same answer whoever's it was, so another tenant's id reveals nothing)."""
        try:
            rows = await self._call(stored.response_chain, tenant_id=tenant_id, response_id=response_id)
        except ServingError as exc:
            if exc.status == 404:
                message = f"Previous response with id '{response_id}' not found."
                if exc.param == "previous_response_id":  # an ancestor of it is gone (tenants.responses)
                    message += " " + exc.message
                raise ServingError(400, "previous_response_not_found", message,
                                   param="previous_response_id") from exc
            if exc.status < 500:  # the id the client sent is refused; a 503 is not about it
                exc.param = "previous_response_id"
            raise
        items: list[dict] = []
        for row in rows:
            items.extend(row.input_items)
            items.extend(row.output_items)
        return StoredChain(items=items, root_id=rows[0].id, ids=tuple(row.id for row in rows))

    async def check_room(self, *, tenant_id: int, incoming: int) -> None:
        await self._call(stored.check_room, tenant_id=tenant_id, incoming=incoming, max_bytes=self.max_bytes)

    async def store(self, *, tenant_id: int, response: dict, input_items: list[dict], root_id: str | None = None,
                    prompt_blocks: list[int] | None = None, ancestor_ids: tuple[str, ...] = ()) -> bool:
        """Store a finished response; False (nothing stored) when the tenant's cap is reached
        meanwhile or the registry fails: the answer is still delivered, with ``store: false``.
        ``root_id`` and ``prompt_blocks`` let a delete on any gateway find what the conversation's
        other live responses hold (``tenants.responses.conversation_rows``); the live responses
        ``ancestor_ids`` (the chain it continues) are kept at least as long as it."""
        body = {k: v for k, v in response.items() if k != "output"}
        try:
            await self._call(stored.store_response, tenant_id=tenant_id, response_id=response["id"],
                             previous_response_id=response.get("previous_response_id"), model=response["model"],
                             input_items=input_items, output_items=response["output"], body=body, ttl=self.ttl,
                             max_bytes=self.max_bytes, root_id=root_id, prompt_blocks=prompt_blocks,
                             ancestor_ids=ancestor_ids)
        except ServingError as exc:
            log.warning("response %s not stored: %s", response["id"], exc.message)
            return False
        except Exception:  # the registry is down: the answer still goes out
            log.exception("response %s not stored", response["id"])
            return False
        return True

    async def purge_expired(self) -> int:
        """One sweep of expired rows (every tenant's); the gateway runs it in a background loop."""
        return await self._call(stored.purge_expired)

    async def get(self, *, tenant_id: int, response_id: str) -> dict:
        row = await self._call(stored.get_response, tenant_id=tenant_id, response_id=response_id)
        return {**row.body, "output": row.output_items}

    async def conversation_rows(self, *, tenant_id: int, response_id: str) -> list[stored.ConversationRow]:
        """The live rows of the response's conversation, itself included (404 if it is gone)."""
        return await self._call(stored.conversation_rows, tenant_id=tenant_id, response_id=response_id)

    async def other_conversations(self, *, tenant_id: int, root_id: str, limit: int
                                  ) -> list[tuple[str, tuple[int, ...] | None]]:
        """(root id, prompt blocks) of the tenant's newest ``limit`` live rows of other conversations."""
        return await self._call(stored.other_conversations, tenant_id=tenant_id, root_id=root_id, limit=limit)

    async def delete(self, *, tenant_id: int, response_id: str) -> None:
        await self._call(stored.delete_response, tenant_id=tenant_id, response_id=response_id)

    async def input_items(self, *, tenant_id: int, response_id: str, limit: int,
                          order: Literal["asc", "desc"], after: str | None, before: str | None = None) -> dict:
        page = await self._call(stored.list_input_items, tenant_id=tenant_id, response_id=response_id, limit=limit,
                                order=order, after=after, before=before)
        data = page.items
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": page.has_more}
