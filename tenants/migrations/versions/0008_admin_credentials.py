"""admin credentials with roles and tenant scopes; per-tenant limit caps

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

Adds ``admin_credentials`` (role, HMAC of the secret, rotation overlap, expiry, last use,
revocation), ``admin_credential_tenants`` (a credential's tenant scope) and
``tenants.limit_caps`` (JSON: the highest value a tenant-admin may set per limit). On
SQLite the column is added and dropped with native ALTER TABLE, as in 0002/0006.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "admin_credentials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("scoped", sa.Boolean(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("previous_secret_hash", sa.String(length=64), nullable=True),
        sa.Column("previous_valid_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('platform-admin', 'operator', 'tenant-admin', 'viewer')",
                           name=op.f("ck_admin_credentials_role_enum")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_credentials")),
        sa.UniqueConstraint("name", name=op.f("uq_admin_credentials_name")),
        sa.UniqueConstraint("prefix", name=op.f("uq_admin_credentials_prefix")),
    )
    op.create_table(
        "admin_credential_tenants",
        sa.Column("credential_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["credential_id"], ["admin_credentials.id"],
                                name=op.f("fk_admin_credential_tenants_credential_id_admin_credentials"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_admin_credential_tenants_tenant_id_tenants"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("credential_id", "tenant_id", name=op.f("pk_admin_credential_tenants")),
    )
    op.create_index(op.f("ix_admin_credential_tenants_tenant_id"), "admin_credential_tenants", ["tenant_id"],
                    unique=False)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE tenants ADD COLUMN limit_caps JSON")
    else:
        op.add_column("tenants", sa.Column("limit_caps", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE tenants DROP COLUMN limit_caps")
    else:
        op.drop_column("tenants", "limit_caps")
    op.drop_index(op.f("ix_admin_credential_tenants_tenant_id"), table_name="admin_credential_tenants")
    op.drop_table("admin_credential_tenants")
    op.drop_table("admin_credentials")
