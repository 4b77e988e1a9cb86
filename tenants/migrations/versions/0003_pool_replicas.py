"""pool replicas: a pool is served by one or more engine endpoints

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Upgrade creates ``pool_replicas``, turns every pool's ``triton_url`` into its first
replica (name ``r0``, state ``active``, weight 1, the pool's timestamps) and drops
``pools.triton_url``. Downgrade recreates ``triton_url`` from each pool's first replica
by id (whatever its state) and drops the table, so replicas beyond the first are lost.

SQLite: the column is dropped and re-added with native ALTER TABLE (SQLite >= 3.35), not
batch mode: batch mode recreates ``pools``, which the tenants' and replicas' foreign keys
forbid while rows exist. SQLite cannot add a NOT NULL column without a default, so there
the downgraded ``triton_url`` keeps ``DEFAULT ''`` (harmless: every row gets a value).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FIRST_ENDPOINT = (
    "(SELECT r.endpoint FROM pool_replicas r WHERE r.pool_id = pools.id ORDER BY r.id LIMIT 1)"
)


def upgrade() -> None:
    op.create_table(
        "pool_replicas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=256), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("state IN ('active', 'draining', 'disabled')", name=op.f("ck_pool_replicas_state_enum")),
        sa.CheckConstraint("weight >= 1", name=op.f("ck_pool_replicas_weight_pos")),
        sa.ForeignKeyConstraint(
            ["pool_id"], ["pools.id"], name=op.f("fk_pool_replicas_pool_id_pools"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pool_replicas")),
        sa.UniqueConstraint("pool_id", "name", name="uq_pool_replicas_pool_id_name"),
    )
    op.create_index(op.f("ix_pool_replicas_pool_id"), "pool_replicas", ["pool_id"], unique=False)
    op.execute(
        "INSERT INTO pool_replicas (pool_id, name, endpoint, state, weight, created_at, updated_at, version) "
        "SELECT id, 'r0', triton_url, 'active', 1, created_at, updated_at, 1 FROM pools ORDER BY id"
    )
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE pools DROP COLUMN triton_url")
    else:
        op.drop_column("pools", "triton_url")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE pools ADD COLUMN triton_url VARCHAR(256) NOT NULL DEFAULT ''")
        op.execute(f"UPDATE pools SET triton_url = COALESCE({FIRST_ENDPOINT}, '')")
    else:
        op.add_column("pools", sa.Column("triton_url", sa.String(length=256), nullable=True))
        op.execute(f"UPDATE pools SET triton_url = COALESCE({FIRST_ENDPOINT}, '')")
        op.alter_column("pools", "triton_url", nullable=False)
    op.drop_index(op.f("ix_pool_replicas_pool_id"), table_name="pool_replicas")
    op.drop_table("pool_replicas")
