"""API-key authentication for the serving API, cached briefly.

Keys are resolved by ``tenants.auth.authenticate_key`` (one indexed query + one HMAC)
in a worker thread, then cached for ``ttl`` seconds under a SHA-256 of the presented
key (the plaintext is never kept). Unknown keys are cached too (negative entries), so
a flood of bad keys costs one database query per distinct key per TTL. ``clear()`` is
called after every admin mutation in this process, so revocations and suspensions made
through this gateway's admin API apply at once; other replicas see them within ``ttl``.

Single flight: when a key's entry is missing or expired, one registry query per key is in
flight at a time; concurrent requests for the same key await that query instead of each
sending their own (a popular key's expiry would otherwise send every request in that
instant to the registry, one worker thread each). Its answer is cached once; its error
reaches every waiter and caches nothing (each waiter falls back to the expired answer or
a 503, as it would alone), so the next request starts a new flight. ``clear()`` detaches
the flights in progress: their answers, read before the admin write, are not cached, and
requests after it start new ones.

Bounded wait: a request waits at most ``lookup_timeout`` seconds for its key's flight,
counted from when the flight began (a registry that stops answering without an error: a
network partition, a frozen primary). Past it, the request is answered as if the registry
had failed: from the expired entry if there is one, else 503 ``registry_unavailable``. The
flight itself goes on in its worker thread (it cannot be interrupted; ``tenants.db`` bounds
it with connect, keepalive and statement timeouts) and caches its answer if one comes; until
it ends, further requests for the key join it and, its deadline past, do not wait at all.

``last_used_at`` is written off the request path: used key ids are collected and
flushed by :meth:`KeyAuthenticator.flush_last_used` (a background task calls it).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from retention.policy.planner import RetentionClassSpec
from server.gateway.admission import Limits
from server.gateway.context import TenantContext
from server.gateway.errors import ServingError
from tenants.auth import authenticate_key, touch_keys_last_used
from tenants.snapshots import AuthenticatedTenant


def to_context(snapshot: AuthenticatedTenant,
               renew: Callable[[], Awaitable[TenantContext | None]] | None = None) -> TenantContext:
    """The request's context from a registry snapshot, with its ``renew`` (built once per
    request: ``dataclasses.replace`` on top would build the frozen context a second time)."""
    pool, cls, lim = snapshot.pool, snapshot.retention, snapshot.limits
    return TenantContext(
        tenant_id=snapshot.tenant_id, slug=snapshot.slug, status=snapshot.status, isolation=snapshot.isolation,
        cache_salt=snapshot.cache_salt,
        limits=Limits(lim.rpm, lim.tpm, lim.max_concurrent_requests, lim.max_prompt_tokens, lim.max_output_tokens),
        kv_quota_fraction=snapshot.kv_quota_fraction,
        pool=pool,
        retention=RetentionClassSpec(cls.system, cls.context, cls.turn, cls.decode),
        key_id=snapshot.key_id,
        retention_mode=cls.mode,
        retention_class=cls.name,
        hints=cls.hints,
        conversation_hold=cls.conversation_hold,
        conversation_end_demote=cls.conversation_end_demote,
        renew=renew,
    )


def _retrieve(flight: asyncio.Future) -> None:
    """Mark a flight's error as seen, so that one whose waiters all left is not logged as lost."""
    if not flight.cancelled():
        flight.exception()


@dataclass(frozen=True, slots=True)
class _Entry:
    expires: float
    snapshot: AuthenticatedTenant | None


LOOKUP_TIMEOUT_S = 3.0  # a healthy lookup takes milliseconds; a loaded gateway's, well under a second


class KeyAuthenticator:
    def __init__(self, session_factory: Callable[[], Session], *, pepper: str, ttl: float = 5.0,
                 max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic,
                 lookup_timeout: float = LOOKUP_TIMEOUT_S) -> None:
        self._sessions = session_factory
        self._pepper = pepper
        self._ttl = ttl
        self._lookup_timeout = lookup_timeout
        self._max = max_entries
        self._clock = clock
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._used: set[int] = set()
        self._flights: dict[bytes, asyncio.Future[AuthenticatedTenant | None]] = {}  # one lookup per key at a time
        self._deadlines: dict[asyncio.Future, float] = {}  # flight -> loop time its waiters stop waiting
        self._generation = 0  # bumped by clear(): a flight begun before it does not cache its answer

    def clear(self, tenant: str | None = None) -> None:
        """Forget cached answers: every one, or only those of ``tenant`` (slug or id).

        Why scoped: the cached answers are also what keeps tenants served while the
        registry is down; an admin write to one tenant must not take that away from all.
        """
        self._generation += 1
        self._flights.clear()  # requests from now on query afresh; waiters of old flights keep theirs
        if tenant is None:
            self._cache.clear()
            return
        stale = [digest for digest, entry in self._cache.items()
                 if entry.snapshot is not None and tenant in (entry.snapshot.slug, str(entry.snapshot.tenant_id))]
        for digest in stale:
            del self._cache[digest]

    def _lookup(self, plaintext: str) -> AuthenticatedTenant | None:
        with self._sessions() as session:
            return authenticate_key(session, plaintext=plaintext, pepper=self._pepper, now=datetime.now(UTC))

    async def _fly(self, digest: bytes, plaintext: str) -> AuthenticatedTenant | None:
        """The one registry query for ``digest``; caches its answer (not an error) unless
        ``clear()`` ran meanwhile."""
        generation = self._generation
        # Why the expiry counts from before the read: counted from the answer, a lookup slowed
        # by a loaded machine (a worker thread waiting for the GIL or a connection) kept a
        # snapshot read before a revocation for its whole duration on top of the TTL.
        read_from = self._clock()
        try:
            snapshot = await anyio.to_thread.run_sync(self._lookup, plaintext)
        finally:
            if self._flights.get(digest) is asyncio.current_task():
                del self._flights[digest]
        if generation == self._generation:
            self._cache[digest] = _Entry(read_from + self._ttl, snapshot)
            self._cache.move_to_end(digest)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return snapshot

    async def _resolve(self, digest: bytes, plaintext: str) -> AuthenticatedTenant | None:
        """Join the key's flight in progress, or start it. The flight is a task of its own
        and is shielded: a waiter that goes away (client disconnect) cancels only its wait.
        Raises ``TimeoutError`` once the flight has run ``lookup_timeout`` seconds."""
        loop = asyncio.get_running_loop()
        flight = self._flights.get(digest)
        if flight is None:
            flight = asyncio.ensure_future(self._fly(digest, plaintext))
            flight.add_done_callback(_retrieve)
            flight.add_done_callback(self._deadlines.pop)
            self._flights[digest] = flight
            self._deadlines[flight] = loop.time() + self._lookup_timeout
        if flight.done():
            return flight.result()
        with anyio.fail_after(max(0.0, self._deadlines[flight] - loop.time())):
            return await asyncio.shield(flight)

    async def authenticate(self, authorization: str | None) -> TenantContext:
        """The tenant behind ``Authorization: Bearer kvg_...`` or a 401/403 :class:`ServingError`."""
        if not authorization or not authorization[:7].lower() == "bearer ":
            raise ServingError(401, "invalid_api_key", "missing API key: send 'Authorization: Bearer kvg_...'")
        plaintext = authorization[7:].strip()
        digest = hashlib.sha256(plaintext.encode("utf-8", "surrogatepass")).digest()
        generation = self._generation
        entry = self._cache.get(digest)
        if entry is None or entry.expires <= self._clock():
            try:
                snapshot = await self._resolve(digest, plaintext)
            except (SQLAlchemyError, TimeoutError) as exc:  # failed, or no answer in time
                if entry is not None and entry.snapshot is not None:
                    snapshot = entry.snapshot  # registry down: serve the last known answer
                else:
                    raise ServingError(503, "registry_unavailable", "the tenant registry is unavailable; retry shortly",
                                       headers={"Retry-After": "1"}) from exc
                # Admission keeps it too: renewing could only ask the same registry again.
                fresh_until = math.inf
            else:
                fresh = self._cache.get(digest)
                # Not cached (a clear() during the read): fresh for no time, admission asks again.
                fresh_until = fresh.expires if fresh is not None and fresh.snapshot is snapshot else self._clock()
        else:
            snapshot, fresh_until = entry.snapshot, entry.expires
        if snapshot is None or snapshot.key_revoked or snapshot.key_expired:
            raise ServingError(401, "invalid_api_key", "invalid, revoked or expired API key")
        if snapshot.status != "active":
            raise ServingError(403, "tenant_suspended", f"tenant '{snapshot.slug}' is suspended")
        self._used.add(snapshot.key_id)

        async def renew() -> TenantContext | None:
            """Why at admission: the limits a request is admitted under must be at most one TTL
            old when admission decides, not when auth ran; on a loaded gateway the two can be
            seconds apart, and a lowered limit would otherwise admit under the old one late."""
            if self._clock() < fresh_until and self._generation == generation:
                return None
            return await self.authenticate(authorization)

        return to_context(snapshot, renew)

    def _touch(self, ids: list[int]) -> None:
        with self._sessions() as session:
            touch_keys_last_used(session, key_ids=ids, now=datetime.now(UTC))

    async def flush_last_used(self) -> int:
        """Write ``last_used_at`` for keys used since the last flush; keeps them on failure."""
        if not self._used:
            return 0
        ids, self._used = sorted(self._used), set()
        try:
            await anyio.to_thread.run_sync(self._touch, ids)
        except SQLAlchemyError:
            self._used.update(ids)
            return 0
        return len(ids)
