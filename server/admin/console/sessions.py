"""Console sessions: kept in memory by the console process, named by a random id.

The browser holds only the session id (cookie ``kvgate_console``: HttpOnly,
SameSite=Strict, Secure over https). The admin credential the user signed in with stays
here, server-side, and is sent to the admin API as a bearer token on each call; it is
never written to a cookie, a page or a log. A session ends on sign-out, after
``idle_s`` without a request, after ``max_age_s`` in all, or when the admin API answers
401 to its credential (revoked or expired). The store is bounded: past ``max_sessions``
the least recently used session is dropped. Sessions are per process: a restart, or a
second console replica, signs users out (documented in docs/architecture.md).

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

    def check_csrf(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self.csrf.encode())

    def flash(self, kind: str, message: str) -> None:
        self.flashes.append((kind, message))

    def take_flashes(self) -> list[tuple[str, str]]:
        out, self.flashes = self.flashes, []
        return out


def _key(session_id: str) -> str:
    # Why hashed: the map's keys are not the cookie values, so a dump of the store names no live cookie.
    return hashlib.sha256(session_id.encode()).hexdigest()


class SessionStore:
    def __init__(self, *, idle_s: float = 1800.0, max_age_s: float = 12 * 3600.0, max_sessions: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.max_age_s, self.max_sessions = idle_s, max_age_s, max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()

    def create(self, *, credential: str, name: str, role: str, tenants: tuple[str, ...] | None) -> tuple[str, ConsoleSession]:
        """A new session and the id to put in the cookie."""
        now = self._clock()
        session_id = secrets.token_urlsafe(32)
        session = ConsoleSession(credential, name, role, tenants, secrets.token_urlsafe(32), now, now)
        self._sessions[_key(session_id)] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session for a cookie value, refreshing its idle timer; expired ones are dropped."""
        if not session_id:
            return None
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = self._clock()
        if now - session.seen > self.idle_s or now - session.created > self.max_age_s:
            del self._sessions[key]
            return None
        session.seen = now
        self._sessions.move_to_end(key)
        return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_key(session_id), None)

    def __len__(self) -> int:
        return len(self._sessions)
