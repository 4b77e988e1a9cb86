"""run's-end demote switch on retention classes

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

Adds ``retention_classes.conversation_end_demote_enabled`` (false: existing classes, with the
conversation hold on or not, send no run's-end demote until an operator enables it). The
switch is independent of ``conversation_hold_enabled`` (0009): the end demote fires for a
class with this switch on, whatever the hold's switch and its duel say. On SQLite the column
is added and dropped with native ALTER TABLE, as in 0002/0006/0009.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "retention_classes"
NAME = "conversation_end_demote_enabled"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(f"ALTER TABLE {TABLE} ADD COLUMN {NAME} BOOLEAN DEFAULT 0 NOT NULL")
    else:
        op.add_column(TABLE, sa.Column(NAME, sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(f"ALTER TABLE {TABLE} DROP COLUMN {NAME}")
    else:
        op.drop_column(TABLE, NAME)
