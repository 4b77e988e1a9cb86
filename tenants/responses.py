"""Stored responses of the OpenAI Responses API: per tenant, with a TTL and a byte cap.

Invariants:

* A response is only ever read, listed, chained or deleted through its tenant's id: another
  tenant's response is "not found" (code ``response_not_found``), exactly like a missing one,
  so an id reveals nothing across tenants.
* An expired response (``expires_at <= now``) is "not found" too; expired rows of a tenant
  are deleted whenever that tenant stores a new one, and every tenant's by
  :func:`purge_expired` (the gateway's sweep, for the space of tenants that stopped storing).
* A conversation lives at least as long as its newest turn: storing a continuation raises the expiry
  of each live ancestor expiring before the new row to the new row's plus half a TTL (one
  UPDATE, in the store's transaction; the half TTL spares a rewrite of the chain on every
  turn), since a continuation needs every link of its chain. An ancestor deleted (or expired
  before it could be kept) leaves its descendants readable but not continuable:
  :func:`response_chain` names the missing link.
* A tenant's stored bytes (``size_bytes`` of its live rows) never exceed ``max_bytes`` by a
  store: :func:`store_response` refuses (``StoreFull``, code ``response_store_full``) and
  stores nothing. Concurrent stores of one tenant check and insert one after the other (on
  PostgreSQL the tenant's row is locked first; on SQLite the store's first statement, a
  DELETE, takes the write lock), so no two of them both fit in the room left for one.
  :func:`check_room` lets the edge refuse before it spends an engine call.
* ``input_items`` keep the request's items in order, each with a unique ``id`` (the gateway
  refuses repeated ids); pages of :func:`list_input_items` are cut by that id (OpenAI's
  ``after`` cursor, and ``before``: the page just before an item); a row stored before repeats were refused serves each repeat renamed
  (:func:`_unique_ids`), so every item is served once and every page moves forward.
* ``root_id`` names the response a stored conversation started with, for every row of it
  (forks included), so :func:`conversation_rows` finds a conversation's live rows with one
  indexed query, on whichever gateway the delete lands. ``prompt_blocks`` (the prompt's full
  blocks' salted hashes, the whole prompt's on every row, so a delete or a demote reads one
  row, never a chain) are the gateway's bookkeeping, not what the tenant stores: they do not
  count in ``size_bytes`` (the cap is about the tenant's inputs, outputs and response body),
  else a conversation's hashes, repeated on each of its rows, would eat the tenant's cap
  quadratically. They are bounded apart: one hash per full block of a prompt the gateway
  served (so at most the model's input window / tokens per block per row), and the rows
  themselves by the cap (each counts its response body, about a kilobyte, at least). Storing
  only the blocks beyond the parent's was not chosen: a continuation's prompt need not extend
  its parent's (``instructions`` are not carried over), and readers would walk chains.

Rows are data, not configuration: no audit events.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from tenants.common import mutation
from tenants.errors import Conflict, InvalidField, NotFound
from tenants.models import StoredResponse, Tenant

MAX_CHAIN = 1024  # previous_response_id links followed at most (a cycle cannot form; this bounds a long one)
MAX_PAGE = 100  # OpenAI's limit for input_items pages


class StoreFull(Conflict):
    """Storing would take the tenant past its byte cap."""

    default_code = "response_store_full"


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """One live stored response of a conversation, as a delete needs it."""

    id: str
    previous_response_id: str | None
    prompt_blocks: tuple[int, ...] | None  # None: stored before prompt blocks were kept


@dataclass(frozen=True, slots=True)
class InputItemsPage:
    items: list[dict[str, Any]]
    has_more: bool


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"no response with id {response_id[:80]!r}", field="response_id", code="response_not_found")


def _broken_chain(response_id: str, missing: str) -> NotFound:
    return NotFound(f"Response {response_id[:80]!r} cannot be continued: the response {missing[:80]!r} it continues "
                    "was deleted or has expired.", field="previous_response_id", code="response_not_found")


def row_size(*, input_items: list, output_items: list, body: dict) -> int:
    """Bytes a row counts against the cap: the length of the JSON parts the tenant stored (its
    ``prompt_blocks`` are not among them: see the module docstring)."""
    return sum(len(json.dumps(part, separators=(",", ":"), ensure_ascii=False).encode())
               for part in (input_items, output_items, body))


def stored_bytes(session: Session, *, tenant_id: int, now: datetime) -> int:
    """The tenant's live stored bytes."""
    total = session.scalar(select(func.coalesce(func.sum(StoredResponse.size_bytes), 0)).where(
        StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at > now))
    return int(total or 0)


def check_room(session: Session, *, tenant_id: int, now: datetime, incoming: int, max_bytes: int) -> None:
    """Raise :class:`StoreFull` if ``incoming`` more bytes would take the tenant past ``max_bytes``."""
    used = stored_bytes(session, tenant_id=tenant_id, now=now)
    if used + incoming > max_bytes:
        raise StoreFull(f"the tenant's stored responses hold {used} bytes; storing {incoming} more would pass the "
                        f"cap of {max_bytes} bytes: delete stored responses or send store: false", field="store")


def store_response(session: Session, *, tenant_id: int, response_id: str, previous_response_id: str | None,
                   model: str, input_items: list, output_items: list, body: dict, now: datetime, ttl: timedelta,
                   max_bytes: int, root_id: str | None = None, prompt_blocks: list[int] | None = None,
                   ancestor_ids: Sequence[str] = ()) -> StoredResponse:
    """Store one response (one transaction); expired rows of the tenant are purged first.

    ``root_id``: the response its conversation started with (its own id for a first turn);
    ``prompt_blocks``: its prompt's full blocks' hashes, root first (see the module docstring);
    ``ancestor_ids``: the chain it continues, whose live rows are kept at least as long as it."""
    if ttl <= timedelta(0):
        raise InvalidField("ttl must be positive", field="ttl")
    if prompt_blocks is not None:
        prompt_blocks = [int(h) for h in prompt_blocks]
    size = row_size(input_items=input_items, output_items=output_items, body=body)
    with mutation(session, unique_field="id", entity="response"):
        _serialize_stores(session, tenant_id=tenant_id)
        session.execute(delete(StoredResponse).where(StoredResponse.tenant_id == tenant_id,
                                                     StoredResponse.expires_at <= now))
        check_room(session, tenant_id=tenant_id, now=now, incoming=size, max_bytes=max_bytes)
        row = StoredResponse(id=response_id, tenant_id=tenant_id, previous_response_id=previous_response_id,
                             model=model, input_items=input_items, output_items=output_items, body=body,
                             size_bytes=size, created_at=now, expires_at=now + ttl, root_id=root_id,
                             prompt_blocks=prompt_blocks)
        session.add(row)
        if ancestor_ids:
            _keep_ancestors(session, tenant_id=tenant_id, ids=ancestor_ids, now=now, until=now + ttl, step=ttl / 2)
    return row


def _serialize_stores(session: Session, *, tenant_id: int) -> None:
    """Make the tenant's concurrent stores check the cap and insert one after the other.

    PostgreSQL: hold the tenant's row (``FOR NO KEY UPDATE``: it waits only for another
    store's lock, never for a key or usage row that merely references the tenant) until the
    store commits; without it two stores each saw the room for one and both inserted. SQLite:
    nothing to take here, the DELETE that follows starts the write transaction (``BEGIN
    IMMEDIATE``), which is the lock."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))


def _keep_ancestors(session: Session, *, tenant_id: int, ids: Sequence[str], now: datetime,
                    until: datetime, step: timedelta) -> None:
    """Keep the live rows ``ids`` of the tenant until at least ``until``: those expiring sooner
    are raised to ``until + step`` (a row already gone stays gone: its descendants are not
    continuable either way). Why the step: a turn of a conversation then rewrites its
    ancestors at most once per ``step``, not on every turn (a conversation of N turns would
    otherwise cost N²/2 row writes); an ancestor outlives its newest turn by at most ``step``."""
    session.execute(update(StoredResponse).where(
        StoredResponse.tenant_id == tenant_id, StoredResponse.id.in_(list(ids)),
        StoredResponse.expires_at > now, StoredResponse.expires_at < until,
    ).values(expires_at=until + step).execution_options(synchronize_session="fetch"))  # rows this session holds too


def get_response(session: Session, *, tenant_id: int, response_id: str, now: datetime) -> StoredResponse:
    """The tenant's live stored response, else not found. An id no stored one can have (not a
    string, over 64 characters, or with a NUL, which PostgreSQL's text cannot hold and refuses as
    a query error) is not found without a query."""
    can_exist = isinstance(response_id, str) and len(response_id) <= 64 and "\x00" not in response_id
    row = session.get(StoredResponse, response_id) if can_exist else None
    if row is None or row.tenant_id != tenant_id or row.expires_at <= now:
        raise _not_found(str(response_id))
    return row


def delete_response(session: Session, *, tenant_id: int, response_id: str, now: datetime) -> None:
    with mutation(session, entity="response"):
        row = get_response(session, tenant_id=tenant_id, response_id=response_id, now=now)
        session.delete(row)


def response_chain(session: Session, *, tenant_id: int, response_id: str, now: datetime) -> list[StoredResponse]:
    """The stored responses from the root of ``response_id``'s chain to it, oldest first.

    Any missing, expired or foreign link is "not found" (the conversation cannot be rebuilt):
    ``response_id`` itself as a plain not found, an ancestor by a message naming both."""
    chain: list[StoredResponse] = []
    seen: set[str] = set()
    current: str | None = response_id
    while current is not None:
        if current in seen or len(chain) >= MAX_CHAIN:
            raise InvalidField(f"the chain of {response_id[:80]!r} is longer than {MAX_CHAIN} responses",
                               field="previous_response_id")
        seen.add(current)
        try:
            row = get_response(session, tenant_id=tenant_id, response_id=current, now=now)
        except NotFound:
            if not chain:
                raise
            raise _broken_chain(response_id, current) from None
        chain.append(row)
        current = row.previous_response_id
    chain.reverse()
    return chain


def conversation_rows(session: Session, *, tenant_id: int, response_id: str, now: datetime
                      ) -> list[ConversationRow]:
    """Every live row of ``response_id``'s conversation (its ``root_id``: ancestors, descendants,
    forks), itself included, oldest first, read from the database alone: a gateway that never
    saw the conversation (restarted, or another one sharing the registry) gets the same answer.

    A row stored without a ``root_id`` is its own conversation. Not found like :func:`get_response`."""
    row = get_response(session, tenant_id=tenant_id, response_id=response_id, now=now)
    if row.root_id is None:
        rows = [row]
    else:
        rows = list(session.scalars(select(StoredResponse).where(
            StoredResponse.tenant_id == tenant_id, StoredResponse.root_id == row.root_id,
            StoredResponse.expires_at > now).order_by(StoredResponse.created_at, StoredResponse.id)))
    return [ConversationRow(r.id, r.previous_response_id,
                            None if r.prompt_blocks is None else tuple(int(h) for h in r.prompt_blocks)) for r in rows]


def other_conversations(session: Session, *, tenant_id: int, root_id: str, now: datetime, limit: int
                        ) -> list[tuple[str, tuple[int, ...] | None]]:
    """``(root id, prompt blocks)`` of the tenant's newest ``limit`` live rows outside the conversation
    ``root_id`` (a row stored without a root is its own conversation), newest first: what an ended
    run's demote must not take from other conversations. Bounded, so an ended run never reads a
    tenant's whole store."""
    rows = session.execute(select(StoredResponse.id, StoredResponse.root_id, StoredResponse.prompt_blocks).where(
        StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at > now,
        or_(StoredResponse.root_id.is_(None), StoredResponse.root_id != root_id),
    ).order_by(StoredResponse.created_at.desc(), StoredResponse.id.desc()).limit(limit))
    return [(root or rid, None if blocks is None else tuple(int(h) for h in blocks)) for rid, root, blocks in rows]


def list_input_items(session: Session, *, tenant_id: int, response_id: str, now: datetime, limit: int = 20,
                     order: Literal["asc", "desc"] = "desc", after: str | None = None,
                     before: str | None = None) -> InputItemsPage:
    """One page of a response's input items (OpenAI's ``GET /responses/{id}/input_items``), in
    ``order``: the first ``limit`` items after ``after``; with ``before``, the last ``limit``
    items before it (the page that precedes it, still in ``order``; ``has_more``: there are
    more before). Both: the items between them."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidField(f"limit must be an integer in [1, {MAX_PAGE}]", field="limit")
    if order not in ("asc", "desc"):
        raise InvalidField("order must be 'asc' or 'desc'", field="order")
    items = _unique_ids(get_response(session, tenant_id=tenant_id, response_id=response_id, now=now).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise InvalidField(f"after: no input item {after[:80]!r} in this response", field="after")
        items = items[at + 1:]
    if before is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == before), None)
        if at is None:
            raise InvalidField(f"before: no input item {before[:80]!r} in this response"
                               + (" after the 'after' item" if after is not None else ""), field="before")
        items = items[:at]
        return InputItemsPage(items[max(0, len(items) - limit):], len(items) > limit)
    return InputItemsPage(items[:limit], len(items) > limit)


def _unique_ids(items: list[dict]) -> list[dict]:
    """The items with unique ids, as pages are cut by them: a row stored before repeated ids
    were refused serves each repeat after the first as ``<id>~<n>`` (its n-th use, or the next
    ``n`` no stored id has), so every item is served once and paging always moves on."""
    taken = {item.get("id") for item in items}  # a new name never clashes with a stored id or another new one
    uses: dict[Any, int] = {}
    out = []
    for item in items:
        ident = item.get("id")
        uses[ident] = uses.get(ident, 0) + 1
        if uses[ident] == 1:
            out.append(item)
            continue
        n = uses[ident]
        while f"{ident}~{n}" in taken:
            n += 1
        taken.add(f"{ident}~{n}")
        out.append({**item, "id": f"{ident}~{n}"})
    return out


def purge_expired(session: Session, *, now: datetime, limit: int = 1000) -> int:
    """Delete up to ``limit`` expired rows of any tenant (one transaction); how many went.

    Idempotent and safe to run from several gateways at once (a row deleted by another is
    simply not counted)."""
    with mutation(session, entity="response"):
        ids = session.scalars(select(StoredResponse.id).where(StoredResponse.expires_at <= now)
                              .order_by(StoredResponse.expires_at).limit(limit)).all()
        if not ids:
            return 0
        result = session.execute(delete(StoredResponse).where(StoredResponse.id.in_(ids),
                                                              StoredResponse.expires_at <= now))
    return int(result.rowcount or 0)
