"""trace captures: opt-in live trace capture per pool (optionally one tenant)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Creates ``trace_captures``. At most one ``active`` capture per pool is kept by a partial
unique index (SQLite and PostgreSQL both support ``WHERE`` on an index). Downgrade drops
the table (captured files on disk are untouched).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "trace_captures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("sample_rate", sa.Float(), nullable=False),
        sa.Column("max_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("state IN ('active', 'stopped')", name=op.f("ck_trace_captures_state_enum")),
        sa.CheckConstraint("sample_rate > 0 AND sample_rate <= 1", name=op.f("ck_trace_captures_sample_rate_range")),
        sa.CheckConstraint("max_bytes >= 1", name=op.f("ck_trace_captures_max_bytes_pos")),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"], name=op.f("fk_trace_captures_pool_id_pools"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_trace_captures_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trace_captures")),
    )
    op.create_index(op.f("ix_trace_captures_pool_id"), "trace_captures", ["pool_id"], unique=False)
    op.create_index(op.f("ix_trace_captures_tenant_id"), "trace_captures", ["tenant_id"], unique=False)
    op.create_index("uq_trace_captures_active_pool", "trace_captures", ["pool_id"], unique=True,
                    sqlite_where=sa.text("state = 'active'"), postgresql_where=sa.text("state = 'active'"))


def downgrade() -> None:
    op.drop_index("uq_trace_captures_active_pool", table_name="trace_captures")
    op.drop_index(op.f("ix_trace_captures_tenant_id"), table_name="trace_captures")
    op.drop_index(op.f("ix_trace_captures_pool_id"), table_name="trace_captures")
    op.drop_table("trace_captures")
