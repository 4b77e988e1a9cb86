"""pool SLO budgets: per-pool latency budget and guard settings for the gateway's SLO guard

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Upgrade creates ``pool_slo_budgets`` (at most one row per pool, deleted with its pool);
no pool gets a budget, so no guard is armed. Downgrade drops the table (budgets are lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pool_slo_budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("ttft_p99_ms", sa.Integer(), nullable=True),
        sa.Column("itl_p99_ms", sa.Integer(), nullable=True),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("min_requests", sa.Integer(), nullable=False),
        sa.Column("cooldown_seconds", sa.Integer(), nullable=False),
        sa.Column("hysteresis", sa.Float(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("pilot_fraction", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("ttft_p99_ms IS NULL OR ttft_p99_ms >= 1", name=op.f("ck_pool_slo_budgets_ttft_p99_ms_pos")),
        sa.CheckConstraint("itl_p99_ms IS NULL OR itl_p99_ms >= 1", name=op.f("ck_pool_slo_budgets_itl_p99_ms_pos")),
        sa.CheckConstraint("window_seconds >= 1", name=op.f("ck_pool_slo_budgets_window_seconds_pos")),
        sa.CheckConstraint("min_requests >= 1", name=op.f("ck_pool_slo_budgets_min_requests_pos")),
        sa.CheckConstraint("cooldown_seconds >= 0", name=op.f("ck_pool_slo_budgets_cooldown_seconds_nonneg")),
        sa.CheckConstraint("hysteresis >= 0 AND hysteresis < 1", name=op.f("ck_pool_slo_budgets_hysteresis_range")),
        sa.CheckConstraint("pilot_fraction >= 0 AND pilot_fraction <= 1",
                           name=op.f("ck_pool_slo_budgets_pilot_fraction_range")),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"], name=op.f("fk_pool_slo_budgets_pool_id_pools"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pool_slo_budgets")),
        sa.UniqueConstraint("pool_id", name=op.f("uq_pool_slo_budgets_pool_id")),
    )


def downgrade() -> None:
    op.drop_table("pool_slo_budgets")
