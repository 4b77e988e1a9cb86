"""Engines and sessions for the registry, on SQLite or PostgreSQL (psycopg 3).

Invariants:

* ``postgresql://`` / ``postgres://`` URLs always use psycopg 3 (``postgresql+psycopg``).
* SQLite connections enforce foreign keys, wait up to ``busy_timeout_s`` for a lock and
  start every write transaction with ``BEGIN IMMEDIATE`` (pysqlite's legacy
  ``isolation_level``): two writers never hold a read snapshot while both try to upgrade
  to a write lock (SQLite would fail one of them with "database is locked" instead of
  waiting), so a lost optimistic-concurrency race surfaces as a 0-row ``UPDATE``.
* File databases use WAL, so readers (the gateway's key lookups) never wait for writers.
* Every wait on the database is bounded, so a registry that stops answering without an
  error (a network partition, a frozen primary) fails calls instead of holding their
  threads forever. SQLite: ``busy_timeout_s`` for a lock. PostgreSQL: ``connect_timeout_s``
  for a connection (psycopg's ``connect_timeout``: the whole handshake), TCP keepalives
  and ``TCP_USER_TIMEOUT`` (``tcp_timeout_s``) for an established one (a peer gone silent
  mid-query, or idle in the pool, is dropped by the kernel), and ``statement_timeout_s``
  for one statement on the server (lock waits included). A migration that needs longer
  statements sets its own (``SET LOCAL statement_timeout``).
"""

from __future__ import annotations

import math

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_DATABASE_URL = "sqlite:///./kvgate.db"


def normalize_url(url: str | URL) -> URL:
    """Return ``url`` with the PostgreSQL driver pinned to psycopg 3."""
    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, *, busy_timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                tcp_timeout_s: float = 30.0, statement_timeout_s: float | None = 30.0, echo: bool = False,
                **kwargs: object) -> Engine:
    """Create an engine with the per-backend settings described in the module docstring.

    PostgreSQL timeouts: ``connect_timeout_s`` (libpq rounds to whole seconds, at least 2),
    ``tcp_timeout_s`` (keepalive probes start after a third of it idle; unacknowledged data
    or probes drop the connection after it), ``statement_timeout_s`` (None: the server's).
    ``connect_args`` given by the caller win over these."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        connect_args = dict(kwargs.pop("connect_args", {}) or {})  # type: ignore[arg-type]
        connect_args.setdefault("timeout", busy_timeout_s)
        connect_args.setdefault("isolation_level", "IMMEDIATE")
        # Why: FastAPI runs sync endpoints in a thread pool; a connection may move threads.
        connect_args.setdefault("check_same_thread", False)
        engine = create_engine(parsed, echo=echo, connect_args=connect_args, **kwargs)  # type: ignore[arg-type]
        in_memory = parsed.database in (None, "", ":memory:")

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            if not in_memory:
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if parsed.get_backend_name() != "postgresql":
        return create_engine(parsed, echo=echo, **kwargs)  # type: ignore[arg-type]
    connect_args = dict(kwargs.pop("connect_args", {}) or {})  # type: ignore[arg-type]
    connect_args.setdefault("connect_timeout", max(2, math.ceil(connect_timeout_s)))
    connect_args.setdefault("keepalives", 1)
    connect_args.setdefault("keepalives_idle", max(1, int(tcp_timeout_s / 3)))
    connect_args.setdefault("keepalives_interval", max(1, int(tcp_timeout_s / 9)))
    connect_args.setdefault("keepalives_count", 3)
    connect_args.setdefault("tcp_user_timeout", int(tcp_timeout_s * 1000))  # milliseconds
    engine = create_engine(parsed, echo=echo, connect_args=connect_args, **kwargs)  # type: ignore[arg-type]
    if statement_timeout_s is not None:
        milliseconds = max(1, int(statement_timeout_s * 1000))

        @event.listens_for(engine, "connect")
        def _pg_statement_timeout(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            # A session setting, not the ``options`` startup parameter: connection poolers such
            # as PgBouncer refuse unknown startup parameters, and a caller's own ``options``
            # (a search_path) stays as given.
            autocommit = dbapi_connection.autocommit
            dbapi_connection.autocommit = True
            try:
                with dbapi_connection.cursor() as cursor:
                    cursor.execute(f"SET statement_timeout = {milliseconds}")
            finally:
                dbapi_connection.autocommit = autocommit

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (services return ORM rows)."""
    return sessionmaker(bind=engine, expire_on_commit=False, autoflush=False)
