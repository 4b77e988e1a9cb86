"""retention class mode (static | adaptive)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

``adaptive`` classes get per-block priorities from the gateway's measured reuse
statistics (retention/policy/adaptive.py) instead of fixed segment priorities. Existing
classes stay ``static``. On SQLite the column (with its named CHECK) is added and dropped
with native ALTER TABLE: batch mode would recreate the table, which the tenants'
foreign key forbids while rows exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


CHECK = "mode IN ('static', 'adaptive')"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE retention_classes ADD COLUMN mode VARCHAR(16) DEFAULT 'static' NOT NULL "
                   f"CONSTRAINT ck_retention_classes_mode_enum CHECK ({CHECK})")
        return
    op.add_column("retention_classes", sa.Column("mode", sa.String(length=16), server_default="static", nullable=False))
    op.create_check_constraint(op.f("ck_retention_classes_mode_enum"), "retention_classes", CHECK)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE retention_classes DROP COLUMN mode")
        return
    op.drop_constraint(op.f("ck_retention_classes_mode_enum"), "retention_classes", type_="check")
    op.drop_column("retention_classes", "mode")
