"""A key's plaintext is never stored or logged.

Drives a key's whole life cycle (create over HTTP, list, authenticate, touch, failed
authentication, revoke, authenticate after revocation, audit listing) with every logger
at DEBUG — SQLAlchemy's statement and parameter logging included — then dumps every
table of the registry and searches the dump and every log line for the secret.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import MetaData, select

from tenants import authenticate_key, touch_keys_last_used
from tests.server.admin.conftest import AUTH, PEPPER, seed

A = "/admin/v1"


def test_plaintext_never_reaches_the_database_or_logs(db, client, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy")  # SQLAlchemy pins its own root logger at WARN
    seed(client)
    created = client.post(f"{A}/tenants/acme/keys", headers=AUTH, json={"name": "prod"}).json()
    plaintext = created["key"]
    secret = plaintext.split("_", 2)[2]
    prefix = created["prefix"]

    listed = client.get(f"{A}/tenants/acme/keys", headers=AUTH).json()
    assert listed["total"] == 1 and "key" not in listed["items"][0]
    with db.factory() as s:
        auth = authenticate_key(s, plaintext=plaintext, pepper=PEPPER, now=datetime.now(UTC))
        assert auth is not None and auth.usable
        logging.getLogger("test").info("authenticated %r", auth)
        touch_keys_last_used(s, key_ids=[auth.key_id], now=datetime.now(UTC))
        assert authenticate_key(s, plaintext=plaintext[:-1] + "x", pepper=PEPPER, now=datetime.now(UTC)) is None
    client.post(f"{A}/tenants/acme/keys/{created['id']}/revoke", headers=AUTH)
    with db.factory() as s:
        auth = authenticate_key(s, plaintext=plaintext, pepper=PEPPER, now=datetime.now(UTC))
        assert auth is not None and auth.key_revoked
    audit_dump = client.get(f"{A}/audit?limit=500", headers=AUTH).text

    meta = MetaData()
    with db.engine.connect() as conn:
        meta.reflect(conn)
        dump = "\n".join(repr(row) for table in meta.sorted_tables for row in conn.execute(select(table)))
    assert "api_keys" in meta.tables and prefix in dump  # the dump really covers the key row
    logs = "\n".join(f"{r.name} {r.getMessage()} {r.args!r}" for r in caplog.records) + caplog.text
    assert "INSERT INTO api_keys" in logs  # SQL parameter logging really was on
    for haystack in (dump, logs, audit_dump):
        assert secret not in haystack
        assert plaintext not in haystack
