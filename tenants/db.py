"""Engines and sessions for the registry, on SQLite or PostgreSQL (psycopg 3).

Invariants:

* ``postgresql://`` / ``postgres://`` URLs always use psycopg 3 (``postgresql+psycopg``).
* SQLite connections enforce foreign keys, wait up to ``busy_timeout_s`` for a lock and
  start every write transaction with ``BEGIN IMMEDIATE`` (pysqlite's legacy
  ``isolation_level``): two writers never hold a read snapshot while both try to upgrade
  to a write lock (SQLite would fail one of them with "database is locked" instead of
  waiting), so a lost optimistic-concurrency race surfaces as a 0-row ``UPDATE``.
* File databases use WAL, so readers (the gateway's key lookups) never wait for writers.
"""

from __future__ import annotations

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


def make_engine(url: str | URL, *, busy_timeout_s: float = 30.0, echo: bool = False, **kwargs: object) -> Engine:
    """Create an engine with the per-backend settings described in the module docstring."""
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
    return create_engine(parsed, echo=echo, **kwargs)  # type: ignore[arg-type]


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (services return ORM rows)."""
    return sessionmaker(bind=engine, expire_on_commit=False, autoflush=False)
