"""retention class hint fields (client cache hints honoured within the class)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

Adds to ``retention_classes``: ``hints_enabled`` (false), ``hint_max_ttl_ms`` (1 h),
``hint_max_priority`` (60) and ``hint_quota_fraction`` (0.5), each with a named CHECK.
Existing classes ignore hints until an operator enables them (plans stay what they were).
On SQLite the columns (with their named CHECKs) are added and dropped with native ALTER
TABLE, as in 0002: batch mode would recreate the table, which the tenants' foreign key
forbids while rows exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (column, SQLite type + default, SQLAlchemy column, check name, check)
COLUMNS = (
    ("hints_enabled", "BOOLEAN DEFAULT 0 NOT NULL",
     sa.Column("hints_enabled", sa.Boolean(), server_default=sa.false(), nullable=False), None, None),
    ("hint_max_ttl_ms", "BIGINT DEFAULT 3600000 NOT NULL",
     sa.Column("hint_max_ttl_ms", sa.BigInteger(), server_default="3600000", nullable=False),
     "ck_retention_classes_hint_max_ttl_ms_pos", "hint_max_ttl_ms > 0"),
    ("hint_max_priority", "INTEGER DEFAULT 60 NOT NULL",
     sa.Column("hint_max_priority", sa.Integer(), server_default="60", nullable=False),
     "ck_retention_classes_hint_max_priority_range", "hint_max_priority >= 0 AND hint_max_priority <= 100"),
    ("hint_quota_fraction", "FLOAT DEFAULT 0.5 NOT NULL",
     sa.Column("hint_quota_fraction", sa.Float(), server_default="0.5", nullable=False),
     "ck_retention_classes_hint_quota_fraction_range", "hint_quota_fraction > 0 AND hint_quota_fraction <= 1"),
)


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, sqlite_type, column, check_name, check in COLUMNS:
        if sqlite:
            constraint = f" CONSTRAINT {check_name} CHECK ({check})" if check else ""
            op.execute(f"ALTER TABLE retention_classes ADD COLUMN {name} {sqlite_type}{constraint}")
            continue
        op.add_column("retention_classes", column)
        if check:
            op.create_check_constraint(op.f(check_name), "retention_classes", check)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, _, _, check_name, check in reversed(COLUMNS):
        if sqlite:
            op.execute(f"ALTER TABLE retention_classes DROP COLUMN {name}")
            continue
        if check:
            op.drop_constraint(op.f(check_name), "retention_classes", type_="check")
        op.drop_column("retention_classes", name)
