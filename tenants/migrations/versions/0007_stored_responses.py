"""stored responses: the OpenAI Responses API's stored responses, per tenant, with a TTL

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

Creates ``stored_responses`` (``tenants.models.StoredResponse``). Rows are data, not
configuration: no audit events. Downgrade drops the table and the stored responses with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("output_items", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_stored_responses_size_bytes_nonneg")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_stored_responses_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    op.create_index("ix_stored_responses_tenant_expires", "stored_responses", ["tenant_id", "expires_at"],
                    unique=False)


def downgrade() -> None:
    op.drop_index("ix_stored_responses_tenant_expires", table_name="stored_responses")
    op.drop_table("stored_responses")
