"""Registry database fixtures, shared by tests/tenants and tests/server/admin.

``db`` is parametrized over SQLite (always) and PostgreSQL (``postgres`` mark; skipped
when 127.0.0.1:5432 is unreachable). Each test run migrates a fresh SQLite file and a
fresh PostgreSQL schema ``kvgate_test_<random>`` (dropped at the end), so concurrent
runs never see each other's rows; between tests every table is emptied.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session, sessionmaker

from tenants import migrate
from tenants.db import make_engine, make_session_factory
from tenants.models import Base

PG_ADMIN_URL = os.environ.get("KVGATE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def postgres_reachable() -> bool:
    url = make_url(PG_ADMIN_URL)
    try:
        with socket.create_connection((url.host or "127.0.0.1", url.port or 5432), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Database:
    backend: str
    url: str
    engine: Engine
    factory: sessionmaker[Session]
    schema: str | None = None

    def clear(self) -> None:
        """Empty every table and restart ids at 1 (DELETE: TRUNCATE costs ~170 ms a call here)."""
        with self.engine.begin() as conn:
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(table.delete())
            if self.backend == "postgresql":
                for table in Base.metadata.sorted_tables:
                    if "id" in table.c and table.c.id.autoincrement is not False and table.c.id.primary_key:
                        conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), 1, false)"))
            elif conn.execute(text("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'")).first():
                conn.execute(text("DELETE FROM sqlite_sequence"))  # AUTOINCREMENT tables' last ids


def pg_engine(schema: str) -> Engine:
    return make_engine(PG_ADMIN_URL, connect_args={"options": f"-csearch_path={schema}"})


def new_pg_schema() -> str:
    schema = f"kvgate_test_{secrets.token_hex(6)}"
    admin = make_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    return schema


def drop_pg_schema(schema: str) -> None:
    admin = make_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


def _sqlite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    path = tmp_path_factory.mktemp("registry") / "kvgate.db"
    url = f"sqlite:///{path}"
    migrate.upgrade(url=url)
    engine = make_engine(url)
    yield Database("sqlite", url, engine, make_session_factory(engine))
    engine.dispose()


def _postgres() -> Iterator[Database]:
    if not postgres_reachable():
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} is unreachable")
    schema = new_pg_schema()
    engine = pg_engine(schema)
    try:
        with engine.begin() as conn:
            migrate.upgrade(connection=conn)
        yield Database("postgresql", PG_ADMIN_URL, engine, make_session_factory(engine), schema=schema)
    finally:
        engine.dispose()
        drop_pg_schema(schema)


@pytest.fixture(scope="session")
def _sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    yield from _sqlite(tmp_path_factory)


@pytest.fixture(scope="session")
def _postgres_db() -> Iterator[Database]:
    yield from _postgres()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest) -> Database:
    """A migrated, empty registry on each backend."""
    database: Database = request.getfixturevalue("_sqlite_db" if request.param == "sqlite" else "_postgres_db")
    database.clear()
    return database


@pytest.fixture
def session(db: Database) -> Iterator[Session]:
    with db.factory() as s:
        yield s
