"""A registry that stops answering without an error: a network partition, a frozen primary.

Nothing resets the connection, so nothing fails: without bounded waits every request for a
key whose cache entry expired waits for the registry forever, and so do ``/readyz`` and the
pool poll loop. With them: a key seen before is served from its last known answer within a
few seconds, an unknown key gets 503 ``registry_unavailable``, ``/readyz`` answers 503 within
its timeout, and the poll loop keeps polling the replicas; once the registry answers again,
so does everything else.

Real PostgreSQL behind :class:`~tests.reliability.proxies.TcpCut`, a TCP forwarder that can stall
(stop moving bytes and hold new connections unanswered) and resume; the registry's engine is
``make_engine``'s for the proxied URL, so its own timeouts are those a deployment gets.
"""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import make_url

from server.gateway.auth import LOOKUP_TIMEOUT_S
from server.gateway.replicas.pool_monitor import LISTING_TIMEOUT_S
from tenants import migrate
from tenants.db import make_engine, make_session_factory
from tests.reliability.proxies import TcpCut
from tests.server.gateway.test_stream_stall import ScriptedReplicas, start_gateway, wait_until
from tests.tenants.fixtures import PG_ADMIN_URL, drop_pg_schema, new_pg_schema, postgres_reachable


@pytest.fixture(scope="module")
def stalled_registry(tmp_path_factory):
    if not postgres_reachable():
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} is unreachable")
    schema = new_pg_schema()
    admin = make_url(PG_ADMIN_URL)
    proxy = TcpCut(admin.port or 5432).start()  # PostgreSQL on loopback
    engine = make_engine(admin.set(host="127.0.0.1", port=proxy.port),
                         connect_args={"options": f"-csearch_path={schema}"})
    gateway = None
    try:
        with engine.begin() as conn:
            migrate.upgrade(connection=conn)
        gateway = start_gateway(tmp_path_factory.mktemp("registry-stall"), ScriptedReplicas(1),
                                factory=make_session_factory(engine))
        gateway.add_tenant("seen")
        gateway.add_tenant("unseen")
        yield gateway, proxy
    finally:
        proxy.close()
        if gateway is not None:
            gateway.close()
        engine.dispose()
        drop_pg_schema(schema)


def timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_a_registry_that_stops_answering_bounds_every_wait_and_serves_known_keys(stalled_registry):
    gateway, proxy = stalled_registry
    assert gateway.chat("seen", max_tokens=2).status_code == 200  # the key's answer is cached
    assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 200
    monitor = gateway.services.monitor
    wait_until(lambda: "scripted" in monitor.last_refresh, what="first pool poll")

    proxy.stall()
    time.sleep(0.5)  # the key's cache entry (auth TTL 0.3 s here) expires
    bound = LOOKUP_TIMEOUT_S + 3.0  # the lookup's timeout, and slack for a loaded machine

    # a key seen before: its last known answer, once the lookup's wait is over ...
    response, took = timed(lambda: gateway.chat("seen", max_tokens=2, timeout=30))
    assert response.status_code == 200, response.text
    assert took < bound, took
    # ... and at once for the next request, whose key's lookup is past its deadline already
    response, took = timed(lambda: gateway.chat("seen", max_tokens=2, timeout=30))
    assert response.status_code == 200, response.text
    assert took < 2.0, took

    # a key never seen: no answer to fall back to
    response, took = timed(lambda: gateway.chat("unseen", max_tokens=2, timeout=30))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "registry_unavailable"
    assert response.headers.get("retry-after") == "1"
    assert took < bound, took

    # /readyz: not ready, within its own timeout, naming the registry
    response, took = timed(lambda: httpx.get(f"{gateway.url}/readyz", timeout=30))
    assert response.status_code == 503 and took < 2.0 + 3.0, took
    assert response.json()["checks"]["registry"].startswith("unavailable")

    # the poll loop goes on (the replicas' health and KV state come from it)
    polled = monitor.last_refresh["scripted"]
    wait_until(lambda: monitor.last_refresh["scripted"] > polled, timeout=LISTING_TIMEOUT_S + 5,
               what="a pool poll during the stall")

    proxy.resume()
    for slug in ("seen", "unseen"):  # the registry answers again: so does everything
        wait_until(lambda: gateway.chat(slug, max_tokens=2, timeout=60).status_code == 200, timeout=60,
                   what=f"{slug} served after the registry came back")
    wait_until(lambda: httpx.get(f"{gateway.url}/readyz", timeout=30).status_code == 200, timeout=30,
               what="ready again")
