"""Console sessions: kept in memory by the console process, named by a random id.

The browser holds only the session id (cookie ``kvgate_console``: HttpOnly,
SameSite=Strict, Secure over https). The admin credential the user signed in with stays
here, server-side, and is sent to the admin API as a bearer token on each call; it is
never written to a cookie, a page or a log. A session ends on sign-out, after
``idle_s`` without a request of the user's (the live panels' polls do not count: an open,
unattended tab signs out too), after ``max_age_s`` in all, or when the admin API answers
401 to its credential (revoked or expired). Sessions are per process: a restart, or a
second console replica, signs users out (documented in docs/architecture.md).

Bounds: one credential holds at most ``max_per_credential`` sessions (a new one drops
that credential's oldest), so no credential can push other users' sessions out; past
``max_sessions`` in all, expired sessions go first, then the least recently used live
one. Failed sign-ins are throttled per client (:class:`SignInThrottle`).

Invariant: a session's CSRF token is random, lives as long as the session, and is
compared in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE = "kvgate_console"
PRE_COOKIE = "kvgate_console_signin"  # double-submit token of the sign-in form (no session yet)


@dataclass(slots=True)
class ConsoleSession:
    credential: str  # the admin bearer token; never leaves the server
    name: str
    role: str  # platform-admin | operator | tenant-admin | viewer
    tenants: tuple[str, ...] | None  # a tenant-admin's tenants; None = every tenant
    csrf: str
    created: float
    seen: float
    flashes: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) shown on the next page
    owner: str = ""  # digest of the credential: whose session this is, for the per-credential cap

    def check_csrf(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self.csrf.encode())

    def flash(self, kind: str, message: str) -> None:
        self.flashes.append((kind, message))

    def take_flashes(self) -> list[tuple[str, str]]:
        out, self.flashes = self.flashes, []
        return out


def _key(secret: str) -> str:
    # Why hashed: the map's keys are not the cookie values (nor credentials), so a dump of the
    # store names no live cookie.
    return hashlib.sha256(secret.encode()).hexdigest()


class SessionStore:
    def __init__(self, *, idle_s: float = 1800.0, max_age_s: float = 12 * 3600.0, max_sessions: int = 10_000,
                 max_per_credential: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.max_age_s = idle_s, max_age_s
        self.max_sessions, self.max_per_credential = max_sessions, max_per_credential
        self.clock = clock
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()  # least recently used first
        self._by_owner: dict[str, list[str]] = {}  # credential digest -> its session keys, oldest first

    def create(self, *, credential: str, name: str, role: str, tenants: tuple[str, ...] | None) -> tuple[str, ConsoleSession]:
        """A new session and the id to put in the cookie."""
        now = self.clock()
        owner = _key(credential)
        while len(self._by_owner.get(owner, ())) >= max(1, self.max_per_credential):
            self._remove(self._by_owner[owner][0])
        if len(self._sessions) >= self.max_sessions:
            for key in [k for k, s in self._sessions.items() if self._expired(s, now)]:
                self._remove(key)
        while self._sessions and len(self._sessions) >= self.max_sessions:
            self._remove(next(iter(self._sessions)))
        session_id = secrets.token_urlsafe(32)
        session = ConsoleSession(credential, name, role, tenants, secrets.token_urlsafe(32), now, now, owner=owner)
        key = _key(session_id)
        self._sessions[key] = session
        self._by_owner.setdefault(owner, []).append(key)
        return session_id, session

    def get(self, session_id: str | None, *, touch: bool = True) -> ConsoleSession | None:
        """The live session for a cookie value; expired ones are dropped. ``touch`` (a request of
        the user's) restarts its idle timer; a live panel's poll reads without touching."""
        if not session_id:
            return None
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = self.clock()
        if self._expired(session, now):
            self._remove(key)
            return None
        if touch:
            session.seen = now
            self._sessions.move_to_end(key)
        return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            self._remove(_key(session_id))

    def _expired(self, session: ConsoleSession, now: float) -> bool:
        return now - session.seen > self.idle_s or now - session.created > self.max_age_s

    def _remove(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        mine = self._by_owner.get(session.owner)
        if mine is not None:
            mine.remove(key)
            if not mine:
                del self._by_owner[session.owner]

    def __len__(self) -> int:
        return len(self._sessions)


class SignInThrottle:
    """Failed sign-ins per client address: a token bucket each (``burst`` failures at once, then
    one more every ``1 / per_s`` seconds). While a client's bucket is empty its sign-ins are
    refused before the credential is tried. Behind a reverse proxy every user shares the
    proxy's address, hence one bucket. Bounded: past ``max_clients`` the client whose last
    failure is oldest is forgotten."""

    def __init__(self, *, burst: int = 10, per_s: float = 0.1, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.per_s, self.max_clients = burst, per_s, max_clients
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)

    def _level(self, client: str, now: float) -> float:
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.per_s)

    def wait_s(self, client: str) -> float:
        """Seconds before ``client`` may try again (0: now)."""
        level = self._level(client, self.clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.per_s

    def failed(self, client: str) -> None:
        now = self.clock()
        self._buckets[client] = (max(0.0, self._level(client, now) - 1.0), now)
        self._buckets.move_to_end(client)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
