"""initial registry schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Hand-checked autogenerate output: every table of tenants/models.py with named
constraints (the metadata naming convention), so downgrade works on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("entity_type", sa.String(length=32), nullable=False),
        sa.Column("entity_id", sa.String(length=64), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(op.f("ix_audit_events_action"), "audit_events", ["action"], unique=False)
    op.create_index(op.f("ix_audit_events_at"), "audit_events", ["at"], unique=False)
    op.create_index("ix_audit_events_entity", "audit_events", ["entity_type", "entity_id"], unique=False)
    op.create_table(
        "pools",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("model_name", sa.String(length=128), nullable=False),
        sa.Column("triton_url", sa.String(length=256), nullable=False),
        sa.Column("triton_model", sa.String(length=128), nullable=False),
        sa.Column("engine_spec", sa.String(length=128), nullable=False),
        sa.Column("tokens_per_block", sa.Integer(), nullable=False),
        sa.Column("primary_blocks", sa.Integer(), nullable=False),
        sa.Column("secondary_blocks", sa.Integer(), nullable=False),
        sa.Column("secondary_offload_min_priority", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("primary_blocks >= 1", name=op.f("ck_pools_primary_blocks_pos")),
        sa.CheckConstraint("secondary_blocks >= 0", name=op.f("ck_pools_secondary_blocks_nonneg")),
        sa.CheckConstraint(
            "secondary_offload_min_priority >= 0 AND secondary_offload_min_priority <= 100",
            name=op.f("ck_pools_secondary_offload_min_priority_range"),
        ),
        sa.CheckConstraint("tokens_per_block >= 1", name=op.f("ck_pools_tokens_per_block_pos")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pools")),
        sa.UniqueConstraint("name", name=op.f("uq_pools_name")),
    )
    op.create_table(
        "retention_classes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("system_priority", sa.Integer(), nullable=False),
        sa.Column("system_duration_ms", sa.BigInteger(), nullable=True),
        sa.Column("context_priority", sa.Integer(), nullable=False),
        sa.Column("context_duration_ms", sa.BigInteger(), nullable=True),
        sa.Column("turn_priority", sa.Integer(), nullable=False),
        sa.Column("turn_duration_ms", sa.BigInteger(), nullable=True),
        sa.Column("decode_priority", sa.Integer(), nullable=False),
        sa.Column("decode_duration_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "context_duration_ms IS NULL OR context_duration_ms >= 0",
            name=op.f("ck_retention_classes_context_duration_ms_nonneg"),
        ),
        sa.CheckConstraint(
            "context_priority >= 0 AND context_priority <= 100",
            name=op.f("ck_retention_classes_context_priority_range"),
        ),
        sa.CheckConstraint(
            "decode_duration_ms IS NULL OR decode_duration_ms >= 0",
            name=op.f("ck_retention_classes_decode_duration_ms_nonneg"),
        ),
        sa.CheckConstraint(
            "decode_priority >= 0 AND decode_priority <= 100", name=op.f("ck_retention_classes_decode_priority_range")
        ),
        sa.CheckConstraint(
            "system_duration_ms IS NULL OR system_duration_ms >= 0",
            name=op.f("ck_retention_classes_system_duration_ms_nonneg"),
        ),
        sa.CheckConstraint(
            "system_priority >= 0 AND system_priority <= 100", name=op.f("ck_retention_classes_system_priority_range")
        ),
        sa.CheckConstraint(
            "turn_duration_ms IS NULL OR turn_duration_ms >= 0",
            name=op.f("ck_retention_classes_turn_duration_ms_nonneg"),
        ),
        sa.CheckConstraint(
            "turn_priority >= 0 AND turn_priority <= 100", name=op.f("ck_retention_classes_turn_priority_range")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retention_classes")),
        sa.UniqueConstraint("name", name=op.f("uq_retention_classes_name")),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slug", sa.String(length=64), nullable=False),
        sa.Column("display_name", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("retention_class_id", sa.Integer(), nullable=False),
        sa.Column("isolation", sa.String(length=16), nullable=False),
        sa.Column("cache_salt", sa.String(length=64), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=False),
        sa.Column("tpm_limit", sa.Integer(), nullable=False),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=False),
        sa.Column("max_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("max_output_tokens", sa.Integer(), nullable=False),
        sa.Column("kv_quota_fraction", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("isolation IN ('shared', 'salted', 'dedicated')", name=op.f("ck_tenants_isolation_enum")),
        sa.CheckConstraint("status IN ('active', 'suspended')", name=op.f("ck_tenants_status_enum")),
        sa.CheckConstraint("kv_quota_fraction > 0 AND kv_quota_fraction <= 1", name=op.f("ck_tenants_kv_quota_range")),
        sa.CheckConstraint(
            "rpm_limit >= 1 AND tpm_limit >= 1 AND max_concurrent_requests >= 1 AND max_prompt_tokens >= 1 AND max_output_tokens >= 1",
            name=op.f("ck_tenants_limits_pos"),
        ),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"], name=op.f("fk_tenants_pool_id_pools"), ondelete="RESTRICT"),
        sa.ForeignKeyConstraint(
            ["retention_class_id"],
            ["retention_classes.id"],
            name=op.f("fk_tenants_retention_class_id_retention_classes"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("slug", name=op.f("uq_tenants_slug")),
    )
    op.create_index(op.f("ix_tenants_pool_id"), "tenants", ["pool_id"], unique=False)
    op.create_index(op.f("ix_tenants_retention_class_id"), "tenants", ["retention_class_id"], unique=False)
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "usage",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "minute", name=op.f("pk_usage")),
    )
    op.create_table(
        "usage_flushes",
        sa.Column("flush_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("row_count", sa.Integer(), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_flushes_tenant_id_tenants"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("flush_id", name=op.f("pk_usage_flushes")),
    )


def downgrade() -> None:
    op.drop_table("usage_flushes")
    op.drop_table("usage")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index(op.f("ix_tenants_retention_class_id"), table_name="tenants")
    op.drop_index(op.f("ix_tenants_pool_id"), table_name="tenants")
    op.drop_table("tenants")
    op.drop_table("retention_classes")
    op.drop_table("pools")
    op.drop_index("ix_audit_events_entity", table_name="audit_events")
    op.drop_index(op.f("ix_audit_events_at"), table_name="audit_events")
    op.drop_index(op.f("ix_audit_events_action"), table_name="audit_events")
    op.drop_table("audit_events")
