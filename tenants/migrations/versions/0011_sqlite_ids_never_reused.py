"""SQLite ids are never reused (AUTOINCREMENT)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04

SQLite gives a new row ``max(id) + 1`` unless its table is declared ``AUTOINCREMENT``: deleting
the newest tenant handed its id to the next tenant created, so a late usage batch of the
deleted tenant was billed to the new one and ``audit tenant/<id>`` mixed two tenants' histories
(api keys, pools, replicas, classes, credentials and captures alike). This migration rebuilds
those tables with ``id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT`` (what the models declare,
``sqlite_autoincrement``); rows keep their ids. The next id continues after the largest id the
table or its audit events ever named, so an id deleted before the upgrade is not handed out
again either.

``audit_events`` (append-only: never deleted, so never reused), ``pool_slo_budgets`` (its id is
never shown; its audit events name the pool) and the tables without an integer id are left
as they are. PostgreSQL sequences never hand out an id twice: a no-op there.

How (SQLite's own procedure for a change ALTER TABLE cannot make, sqlite.org/lang_altertable.html):
the new table is created from the stored ``CREATE TABLE`` text with only the id's definition
changed, so every column, default and CHECK stays exactly as written, column CHECKs included
(a reflected rebuild, alembic's batch mode, turns them into table CHECKs, after which the
native ``DROP COLUMN`` of the 0002/0006 downgrades fails); the rows are copied, the old table
dropped, the new one renamed and the table's indexes recreated from their stored text. The
DROP would delete (cascade) every child row with foreign keys on, so they are off during the
rebuild; ``PRAGMA foreign_keys`` is ignored inside a transaction, so on SQLite this migration
commits what ran before it, rebuilds in a transaction of its own (``PRAGMA foreign_key_check``
must find no broken reference it did not find before, or nothing commits) and then restores
the connection's setting. The downgrade
rebuilds the same tables with the table-level ``pk_<table>`` constraint again, the same way.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table -> the audit entity_type whose entity_id is that table's id
TABLES = {
    "retention_classes": "retention_class",
    "pools": "pool",
    "pool_replicas": "pool_replica",
    "tenants": "tenant",
    "api_keys": "api_key",
    "admin_credentials": "admin_credential",
    "trace_captures": "trace_capture",
}
_ID_PLAIN = re.compile(r'(?m)^(\s*)"?id"? INTEGER NOT NULL,')
_ID_AUTO = re.compile(r'(?m)^(\s*)"?id"? INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,')


@contextmanager
def _own_transaction_without_foreign_keys(raw: sqlite3.Connection) -> Iterator[None]:
    if raw.in_transaction:  # PRAGMA foreign_keys is a no-op inside a transaction
        raw.commit()
    was_on = raw.execute("PRAGMA foreign_keys").fetchone()[0]
    raw.execute("PRAGMA foreign_keys=OFF")
    try:
        raw.execute("BEGIN IMMEDIATE")
        try:
            before = set(raw.execute("PRAGMA foreign_key_check").fetchall())
            yield
            broken = set(raw.execute("PRAGMA foreign_key_check").fetchall()) - before
            if broken:
                raise RuntimeError(f"rebuilding the registry's tables would break references: {sorted(broken)[:5]}")
            raw.commit()
        except BaseException:
            raw.rollback()
            raise
    finally:
        raw.execute(f"PRAGMA foreign_keys={'ON' if was_on else 'OFF'}")


def _one(pattern: str | re.Pattern[str], replacement: str, sql: str, *, table: str) -> str:
    out, count = re.subn(pattern, replacement, sql, count=1)
    if count != 1:
        raise RuntimeError(f"table {table}: its stored definition is not the one this migration knows; "
                           f"nothing was changed ({sql[:200]!r})")
    return out


def _with_autoincrement(sql: str, table: str) -> str:
    sql = _one(_ID_PLAIN, r"\1id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,", sql, table=table)
    pk = rf'CONSTRAINT "?pk_{table}"? PRIMARY KEY \("?id"?\)'
    if re.search(rf"{pk}\s*,", sql):
        return _one(rf"\s*{pk}\s*,", "", sql, table=table)
    return _one(rf",\s*{pk}(\s*\)\s*)$", r"\1", sql, table=table)


def _without_autoincrement(sql: str, table: str) -> str:
    sql = _one(_ID_AUTO, r"\1id INTEGER NOT NULL,", sql, table=table)
    if "\n\tCONSTRAINT " in sql:
        return sql.replace("\n\tCONSTRAINT ", f"\n\tCONSTRAINT pk_{table} PRIMARY KEY (id), \n\tCONSTRAINT ", 1)
    return _one(r"(\s*\)\s*)$", rf", \n\tCONSTRAINT pk_{table} PRIMARY KEY (id)\1", sql, table=table)


def _rebuild(raw: sqlite3.Connection, table: str, sql: str) -> None:
    """Create ``sql`` (``table``'s new definition) as a new table, copy the rows, swap, re-index."""
    indexes = [s for (s,) in raw.execute(
        "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND type IN ('index', 'trigger') AND sql IS NOT NULL",
        (table,))]
    columns = ", ".join(f'"{name}"' for _, name, *_ in raw.execute(f'PRAGMA table_info("{table}")'))
    scratch = f"_kvgate_new_{table}"
    raw.execute(_one(rf'^CREATE TABLE\s+("?){table}\1\s*\(', f'CREATE TABLE "{scratch}" (', sql, table=table))
    raw.execute(f'INSERT INTO "{scratch}" ({columns}) SELECT {columns} FROM "{table}"')
    raw.execute(f'DROP TABLE "{table}"')
    raw.execute(f'ALTER TABLE "{scratch}" RENAME TO "{table}"')
    for statement in indexes:
        raw.execute(statement)


def _last_id(raw: sqlite3.Connection, table: str, entity_type: str) -> int:
    """The largest id the table holds or its audit events ever named (an INT32, digits only)."""
    row = raw.execute(
        f'SELECT max(coalesce((SELECT max(id) FROM "{table}"), 0), coalesce((SELECT max(CAST(entity_id AS INTEGER)) '
        "FROM audit_events WHERE entity_type = ? AND entity_id != '' AND entity_id NOT GLOB '*[^0-9]*' "
        "AND length(entity_id) <= 10 AND CAST(entity_id AS INTEGER) <= 2147483647), 0))", (entity_type,)).fetchone()
    return int(row[0] or 0)


def _migrate(*, autoincrement: bool) -> None:
    if op.get_context().as_sql:
        raise NotImplementedError("0011 rebuilds SQLite tables from their stored definitions: run it online "
                                  "(kvgate db upgrade), not as an offline SQL script")
    raw = op.get_bind().connection.dbapi_connection
    assert isinstance(raw, sqlite3.Connection)
    with _own_transaction_without_foreign_keys(raw):
        for table, entity_type in TABLES.items():
            (sql,) = raw.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
            if ("AUTOINCREMENT" in sql.upper()) == autoincrement:
                continue  # already so (a rebuild that ran before its revision was recorded)
            _rebuild(raw, table, _with_autoincrement(sql, table) if autoincrement else _without_autoincrement(sql, table))
            if autoincrement:
                # The copy left sqlite_sequence at the largest id copied; an id deleted before is
                # known from its audit events (every create is audited, and events are never deleted).
                raw.execute("DELETE FROM sqlite_sequence WHERE name = ?", (table,))
                last = _last_id(raw, table, entity_type)
                if last:
                    raw.execute("INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, last))


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _migrate(autoincrement=True)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _migrate(autoincrement=False)
