"""API-key authentication against a real SQLite registry: one registry query per key at a
time when its cached entry has expired (single flight), errors shared by every waiter and
never cached.

Registry queries are counted with an SQLAlchemy ``before_cursor_execute`` listener on the
registry's engine (the key lookup reads ``api_keys``); the listener also holds each query
for a moment, so that the concurrent requests surely overlap it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import event, text

from server.gateway.auth import KeyAuthenticator
from server.gateway.errors import ServingError
from tenants import keys, migrate
from tenants.db import make_engine, make_session_factory
from tests.tenants.factories import ACTOR, make_placement, now

PEPPER = "auth-test-pepper-0123456789abcdef"
TTL = 5.0
N = 32  # concurrent requests: more than a few worker threads' worth


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Registry:
    """A migrated SQLite registry with one tenant and key; counts the key lookups."""

    def __init__(self, tmp: Path) -> None:
        url = f"sqlite:///{tmp / 'registry.db'}"
        migrate.upgrade(url=url)
        self.engine = make_engine(url)
        self.factory = make_session_factory(self.engine)
        with self.factory() as session:
            make_placement(session)
        with self.factory() as session:
            self.key = keys.create_key(session, actor=ACTOR, now=now(), tenant="acme", pepper=PEPPER, name="k")[1]
        self.lookups = 0
        self._lock = threading.Lock()
        event.listen(self.engine, "before_cursor_execute", self._count)

    def _count(self, conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        if "WHERE api_keys.prefix = " in statement:  # the lookup's first query (by key prefix)
            with self._lock:
                self.lookups += 1
            time.sleep(0.05)  # hold the query: the other requests arrive while it is in flight

    def rename_keys_table(self, name: str, to: str) -> None:
        """Make the registry fail for real (no such table) and heal it again."""
        with self.engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {name} RENAME TO {to}"))


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    built = Registry(tmp_path)
    yield built
    built.engine.dispose()


def authenticator(registry: Registry, clock: Clock) -> KeyAuthenticator:
    return KeyAuthenticator(registry.factory, pepper=PEPPER, ttl=TTL, clock=clock)


async def burst(auth: KeyAuthenticator, key: str, n: int = N) -> list:
    return await asyncio.gather(*(auth.authenticate(f"Bearer {key}") for _ in range(n)), return_exceptions=True)


def test_an_expired_entry_is_refreshed_by_one_registry_query(registry: Registry) -> None:
    clock = Clock()
    auth = authenticator(registry, clock)

    async def run() -> tuple[list, list]:
        first = await burst(auth, registry.key)  # cold cache: one query too
        clock.t += TTL + 1  # the entry expires
        return first, await burst(auth, registry.key)

    first, second = asyncio.run(run())
    assert all(ctx.slug == "acme" for ctx in first + second)
    assert registry.lookups == 2  # one per flight, not one per request


def test_an_error_reaches_every_waiter_and_is_not_cached(registry: Registry) -> None:
    clock = Clock()
    auth = authenticator(registry, clock)

    async def run() -> tuple[list, list, list]:
        registry.rename_keys_table("api_keys", "api_keys_away")
        failed = await burst(auth, registry.key)  # nothing cached: every waiter gets the 503
        lookups_failed = registry.lookups
        registry.rename_keys_table("api_keys_away", "api_keys")
        healed = await burst(auth, registry.key)  # a new flight, not the failed one's answer
        lookups_healed = registry.lookups
        clock.t += TTL + 1
        registry.rename_keys_table("api_keys", "api_keys_away")
        stale = await burst(auth, registry.key)  # expired entry + registry down: the last answer is served
        registry.rename_keys_table("api_keys_away", "api_keys")
        return [failed, lookups_failed], [healed, lookups_healed], [stale, registry.lookups]

    (failed, after_fail), (healed, after_heal), (stale, after_stale) = asyncio.run(run())
    assert after_fail == 1 and len(failed) == N
    assert all(isinstance(e, ServingError) and e.status == 503 and e.code == "registry_unavailable" for e in failed)
    assert after_heal == 2 and all(ctx.slug == "acme" for ctx in healed)
    assert after_stale == 3 and all(ctx.slug == "acme" for ctx in stale)


def test_a_waiter_that_leaves_does_not_cancel_the_flight(registry: Registry) -> None:
    clock = Clock()
    auth = authenticator(registry, clock)

    async def run() -> list:
        leaving = asyncio.ensure_future(auth.authenticate(f"Bearer {registry.key}"))
        await asyncio.sleep(0.01)  # the flight is under way
        staying = asyncio.ensure_future(auth.authenticate(f"Bearer {registry.key}"))
        await asyncio.sleep(0)
        leaving.cancel()  # e.g. the client disconnected
        return [await staying, await auth.authenticate(f"Bearer {registry.key}")]

    results = asyncio.run(run())
    assert [ctx.slug for ctx in results] == ["acme", "acme"]
    assert registry.lookups == 1  # the flight finished and its answer was cached


def test_clear_during_a_flight_does_not_cache_its_answer(registry: Registry) -> None:
    clock = Clock()
    auth = authenticator(registry, clock)

    async def run() -> None:
        early = asyncio.ensure_future(auth.authenticate(f"Bearer {registry.key}"))
        await asyncio.sleep(0.01)
        auth.clear()  # an admin write while the lookup is in flight
        late = await auth.authenticate(f"Bearer {registry.key}")  # a new flight, after the write
        assert (await early).slug == late.slug == "acme"

    asyncio.run(run())
    assert registry.lookups == 2
