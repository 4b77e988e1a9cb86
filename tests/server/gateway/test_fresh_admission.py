"""A lowered concurrency limit binds every admission decided one auth TTL after the change.

Two gateways (two :class:`KeyAuthenticator` s on one SQLite registry, one fake clock) share
Redis admission. Requests are authenticated while the tenant's limit is 8; the limit is
lowered to 2 in the registry (as an admin write through another process does: no gateway's
cache is cleared); admission runs for those requests only after the auth TTL has passed
(the gap a loaded gateway puts between auth and admission). Counted: leases Redis holds for
the tenant, the count every gateway's admission decides on.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from sqlalchemy import text

from server.gateway.admission import AdmissionError, Lease, Limits, RedisAdmission
from server.gateway.auth import KeyAuthenticator
from server.gateway.errors import ServingError
from server.gateway.fresh_admission import admit
from tenants import keys, migrate, tenant
from tenants.db import make_engine, make_session_factory
from tests.server.gateway.test_admission import REDIS_URL, _redis_up
from tests.tenants.factories import ACTOR, make_placement, now

PEPPER = "fresh-admission-pepper-0123456789ab"
TTL = 5.0
OLD, NEW = 8, 2

pytestmark = pytest.mark.skipif(not _redis_up(), reason="Redis at 127.0.0.1:6379 is not reachable")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Fleet:
    """The registry, the shared clock, two gateways' authenticators and admissions."""

    def __init__(self, tmp: Path) -> None:
        url = f"sqlite:///{tmp / 'registry.db'}"
        migrate.upgrade(url=url)
        self.factory = make_session_factory(make_engine(url))
        with self.factory() as session:
            make_placement(session)
        self.set_limit(OLD)
        with self.factory() as session:
            self.key = keys.create_key(session, actor=ACTOR, now=now(), tenant="acme", pepper=PEPPER, name="k")[1]
        self.clock = Clock()
        self.auths = [KeyAuthenticator(self.factory, pepper=PEPPER, ttl=TTL, clock=self.clock) for _ in range(2)]
        self.namespace = f"kvgate-test-{secrets.token_hex(4)}"
        self.admissions = [RedisAdmission(REDIS_URL, namespace=self.namespace) for _ in range(2)]

    def set_limit(self, value: int) -> None:
        with self.factory() as session:
            row = tenant.get_tenant(session, ref="acme")
            tenant.update_tenant(session, actor=ACTOR, now=now(), ref="acme", version=row.version,
                                 changes={"max_concurrent_requests": value})

    def revoke(self) -> None:
        with self.factory() as session:
            key_id = keys.list_keys(session, tenant="acme", limit=10, offset=0).items[0].id
            keys.revoke_key(session, actor=ACTOR, now=now(), tenant="acme", key_id=key_id)

    async def close(self) -> None:
        first = self.admissions[0]
        found = [k async for k in first._redis.scan_iter(f"{self.namespace}:*")]
        if found:
            await first._redis.delete(*found)
        for admission in self.admissions:
            await admission.close()


@pytest.fixture
async def fleet(tmp_path: Path):
    built = Fleet(tmp_path)
    yield built
    await built.close()


async def _admit_all(fleet: Fleet, contexts) -> tuple[list[Lease], list[AdmissionError]]:
    granted, refused = [], []
    for i, context in enumerate(contexts):
        try:
            granted.append(await admit(fleet.admissions[i % 2], context, prompt_tokens=4, max_output_tokens=4))
        except AdmissionError as exc:
            refused.append(exc)
    return granted, refused


async def test_requests_authenticated_under_the_old_limit_are_admitted_under_the_new_one_past_the_ttl(fleet) -> None:
    header = f"Bearer {fleet.key}"
    contexts = [await fleet.auths[i % 2].authenticate(header) for i in range(OLD)]
    assert {c.limits.max_concurrent for c in contexts} == {OLD}
    fleet.set_limit(NEW)
    fleet.clock.t += TTL  # admission decides one TTL after the registry reads the contexts came from
    granted, refused = await _admit_all(fleet, contexts)
    assert len(granted) == NEW
    assert await fleet.admissions[0].in_flight("acme") == NEW
    assert {e.limit for e in refused} == {"max_concurrent"} and len(refused) == OLD - NEW


async def test_within_the_ttl_the_cached_limit_still_admits(fleet) -> None:
    """The stated bound is one TTL: before it, the snapshot read before the change decides."""
    header = f"Bearer {fleet.key}"
    contexts = [await fleet.auths[i % 2].authenticate(header) for i in range(NEW + 1)]
    fleet.set_limit(NEW)
    fleet.clock.t += TTL / 2
    granted, refused = await _admit_all(fleet, contexts)
    assert (len(granted), refused) == (NEW + 1, [])


class SlowDecision:
    """Admission whose decision lands after the TTL has run out (a slow round trip)."""

    def __init__(self, inner: RedisAdmission, clock: Clock) -> None:
        self.inner, self.clock = inner, clock

    async def acquire(self, tenant: str, limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> Lease:
        self.clock.t += TTL
        return await self.inner.acquire(tenant, limits, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens)

    async def release(self, lease: Lease, *, completion_tokens: int) -> None:
        await self.inner.release(lease, completion_tokens=completion_tokens)

    async def release_unserved(self, lease: Lease) -> None:
        await self.inner.release_unserved(lease)

    async def close(self) -> None:
        return None


async def test_a_decision_that_outlasts_the_ttl_is_made_again_under_the_lowered_limit(fleet) -> None:
    header = f"Bearer {fleet.key}"
    held, _ = await _admit_all(fleet, [await fleet.auths[0].authenticate(header) for _ in range(NEW)])
    assert len(held) == NEW
    late = await fleet.auths[1].authenticate(header)  # limit OLD, fresh when admission starts
    fleet.set_limit(NEW)
    with pytest.raises(AdmissionError) as info:
        await admit(SlowDecision(fleet.admissions[1], fleet.clock), late, prompt_tokens=4, max_output_tokens=4)
    assert info.value.limit == "max_concurrent"
    assert await fleet.admissions[0].in_flight("acme") == NEW


async def test_a_key_revoked_before_admission_past_the_ttl_is_refused(fleet) -> None:
    context = await fleet.auths[0].authenticate(f"Bearer {fleet.key}")
    fleet.revoke()
    fleet.clock.t += TTL
    with pytest.raises(ServingError) as info:
        await admit(fleet.admissions[0], context, prompt_tokens=4, max_output_tokens=4)
    assert info.value.status == 401
    assert await fleet.admissions[0].in_flight("acme") == 0


async def test_registry_down_admission_keeps_the_last_known_answer_auth_served(fleet) -> None:
    """As authentication does while the registry is unreachable; renewing would only ask it again."""
    header = f"Bearer {fleet.key}"
    await fleet.auths[0].authenticate(header)  # cached
    fleet.clock.t += TTL
    with fleet.factory() as session:  # the registry fails for real: no such table
        session.execute(text("ALTER TABLE api_keys RENAME TO api_keys_away"))
        session.commit()
    context = await fleet.auths[0].authenticate(header)  # expired entry, registry down: last known answer
    fleet.clock.t += TTL
    lease = await admit(fleet.admissions[0], context, prompt_tokens=4, max_output_tokens=4)
    assert lease.tenant == "acme" and await fleet.admissions[0].in_flight("acme") == 1
