"""cache token counters in the usage ledger

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

Adds to ``usage``: ``cache_read_tokens`` (prompt tokens served from the KV cache),
``cache_write_5m_tokens`` and ``cache_write_1h_tokens`` (prompt tokens kept under a client
cache hint, by the TTL they were kept for), each BIGINT NOT NULL DEFAULT 0: minutes counted
before the upgrade read 0, as do the lines of an older gateway's journal. On SQLite the
columns are added and dropped with native ALTER TABLE, as in 0002/0006/0009/0010.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "usage"
NAMES = ("cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens")


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name in NAMES:
        if sqlite:
            op.execute(f"ALTER TABLE {TABLE} ADD COLUMN {name} BIGINT DEFAULT 0 NOT NULL")
        else:
            op.add_column(TABLE, sa.Column(name, sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name in reversed(NAMES):
        if sqlite:
            op.execute(f"ALTER TABLE {TABLE} DROP COLUMN {name}")
        else:
            op.drop_column(TABLE, name)
