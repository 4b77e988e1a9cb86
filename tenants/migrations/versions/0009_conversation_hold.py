"""conversation hold switch on retention classes; stored responses' conversation root and prompt blocks

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

Adds ``retention_classes.conversation_hold_enabled`` (false: existing classes, with hints on
or not, hold no tool loop or stored conversation until an operator enables it), and to
``stored_responses``: ``root_id`` (the id of the response the conversation started with) and
``prompt_blocks`` (JSON: the prompt's full blocks' salted hashes), both NULL in existing rows,
with the index ``ix_stored_responses_tenant_root`` (tenant_id, root_id). On SQLite the
columns are added and dropped with native ALTER TABLE, as in 0002/0006.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, SQLite type + default, SQLAlchemy column)
COLUMNS = (
    ("retention_classes", "conversation_hold_enabled", "BOOLEAN DEFAULT 0 NOT NULL",
     sa.Column("conversation_hold_enabled", sa.Boolean(), server_default=sa.false(), nullable=False)),
    ("stored_responses", "root_id", "VARCHAR(64)", sa.Column("root_id", sa.String(length=64), nullable=True)),
    ("stored_responses", "prompt_blocks", "JSON", sa.Column("prompt_blocks", sa.JSON(), nullable=True)),
)
INDEX = "ix_stored_responses_tenant_root"


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for table, name, sqlite_type, column in COLUMNS:
        if sqlite:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sqlite_type}")
        else:
            op.add_column(table, column)
    op.create_index(INDEX, "stored_responses", ["tenant_id", "root_id"], unique=False)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.drop_index(INDEX, table_name="stored_responses")
    for table, name, _, _ in reversed(COLUMNS):
        if sqlite:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
        else:
            op.drop_column(table, name)
