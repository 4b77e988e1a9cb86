"""The Responses API while the registry is unreachable: 503 ``registry_unavailable``, never 500.

Stored responses live in the registry database. When it cannot be reached (connection
refused, a dropped connection, a pool with no free connection in time) every route that
needs it answers as authentication does: 503 ``registry_unavailable`` with ``Retry-After: 1``,
so clients retry; a request that does not touch the store (``store: false`` without
``previous_response_id``) is still served.

End to end: a real gateway over HTTP on a SQLite registry whose connections are refused on
demand (the key is authenticated while it is up; authentication then serves its last known
answer). Then the store alone on a real PostgreSQL: connection refused, and a pool exhausted.
"""

from __future__ import annotations

import socket
import sqlite3
import time

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.pool import NullPool

from server.gateway.errors import ServingError
from server.gateway.response_store import ResponseStore
from tenants.db import make_engine, make_session_factory
from tests.server.gateway.test_admission_reservation import MODEL, FixedEngine, start_gateway
from tests.tenants.fixtures import PG_ADMIN_URL, postgres_reachable

@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    engine = FixedEngine()
    engine.answer(4)
    # NullPool: every session connects, so refusing connections takes the registry away at once.
    built = start_gateway(tmp_path_factory.mktemp("responses-outage"), engine, poolclass=NullPool)

    @event.listens_for(built.db_engine, "do_connect")
    def refuse(dialect, conn_rec, cargs, cparams):
        if built.unreachable:
            raise sqlite3.OperationalError("unable to open database file (registry taken away by the test)")

    yield built
    built.unreachable = False
    built.close()
    engine.close()


def assert_unavailable(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers.get("retry-after") == "1"
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == ("registry_unavailable", "service_unavailable"), error


@pytest.mark.parametrize("retention_class", ["chat", "held"])  # held: a delete reads the store before deleting
def test_every_route_that_needs_the_store_answers_503_while_the_registry_is_away(gateway, retention_class) -> None:
    slug = "outage-" + retention_class
    gateway.add_tenant(slug, retention_class=retention_class)
    headers = gateway.headers(slug)
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 4}
    first = httpx.post(gateway.url + "/v1/responses", json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    gateway.unreachable = True
    try:
        time.sleep(0.4)  # past the auth TTL (0.2 s): authentication serves its last known answer
        # The registry is away for everything, not only for stored responses: auth still admits.
        assert httpx.post(gateway.url + "/v1/responses", json={**body, "store": False}, headers=headers,
                          timeout=30).status_code == 200
        for method, path, payload in [
            ("POST", "/v1/responses", body),  # stored: room is checked before generating
            ("POST", "/v1/responses", {**body, "store": False, "previous_response_id": rid}),
            ("POST", "/v1/responses", {**body, "previous_response_id": rid}),
            ("GET", f"/v1/responses/{rid}", None),
            ("GET", f"/v1/responses/{rid}/input_items", None),
            ("DELETE", f"/v1/responses/{rid}", None),
        ]:
            assert_unavailable(httpx.request(method, gateway.url + path, json=payload, headers=headers, timeout=30))
    finally:
        gateway.unreachable = False
    # Back: nothing was lost or half-deleted.
    again = httpx.get(f"{gateway.url}/v1/responses/{rid}", headers=headers, timeout=30)
    assert again.status_code == 200 and again.json()["id"] == rid
    deleted = httpx.delete(f"{gateway.url}/v1/responses/{rid}", headers=headers, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True


# The store alone, on PostgreSQL --------------------------------------------------------------------
needs_postgres = pytest.mark.skipif(not postgres_reachable(), reason="PostgreSQL at 127.0.0.1:5432 is not reachable")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _assert_every_call_unavailable(store: ResponseStore) -> None:
    calls = [
        lambda: store.get(tenant_id=1, response_id="resp_x"),
        lambda: store.chain(tenant_id=1, response_id="resp_x"),
        lambda: store.check_room(tenant_id=1, incoming=10),
        lambda: store.input_items(tenant_id=1, response_id="resp_x", limit=20, order="desc", after=None),
        lambda: store.conversation_rows(tenant_id=1, response_id="resp_x"),
        lambda: store.delete(tenant_id=1, response_id="resp_x"),
    ]
    for call in calls:
        with pytest.raises(ServingError) as info:
            await call()
        error = info.value
        assert (error.status, error.code, error.headers) == (503, "registry_unavailable", {"Retry-After": "1"})
        assert error.param is None  # nothing the client sent is wrong


@pytest.mark.postgres
@needs_postgres
async def test_a_refused_postgres_connection_is_registry_unavailable() -> None:
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/test"
    engine = make_engine(url, connect_args={"connect_timeout": 2})
    try:
        await _assert_every_call_unavailable(ResponseStore(make_session_factory(engine)))
    finally:
        engine.dispose()


@pytest.mark.postgres
@needs_postgres
async def test_an_exhausted_postgres_pool_is_registry_unavailable() -> None:
    engine = make_engine(PG_ADMIN_URL, pool_size=1, max_overflow=0, pool_timeout=0.2)
    held = engine.connect()  # the only connection, taken: a checkout waits pool_timeout, then fails
    try:
        await _assert_every_call_unavailable(ResponseStore(make_session_factory(engine)))
    finally:
        held.close()
        engine.dispose()
