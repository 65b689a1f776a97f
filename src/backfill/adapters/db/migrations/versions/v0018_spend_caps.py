"""spend caps: caps per org or key and period, and what they count (a row per batch and per
GPU-time receipt)

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_ENDED = "('cancelled', 'completed', 'expired', 'failed')"


def upgrade() -> None:
    op.create_table(
        "spend_caps",
        sa.Column("scope_id", sa.String(64), primary_key=True),
        sa.Column("period", sa.String(8), primary_key=True),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("org_id", sa.String(64), sa.ForeignKey("orgs.id"), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_spend_caps_org", "spend_caps", ["org_id"])
    op.create_table(
        "spend",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(64), sa.ForeignKey("orgs.id"), nullable=False),
        sa.Column("api_key_id", sa.String(64)),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("settled", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_spend_org", "spend", ["org_id", "created_at"])
    op.create_index("ix_spend_key", "spend", ["api_key_id", "created_at"])
    # What was spent before caps existed counts under the caps set from now on: every batch
    # (no key: the creating key was not stored), GPU time by org and UTC day as the store adds
    # it, and the charges of batches deleted since, dated at their first charge (their creation
    # is gone with them). Whole seconds and days rounded down (SQLite's CAST truncates).
    seconds = (
        "CAST({} AS INTEGER)"
        if op.get_bind().dialect.name == "sqlite"
        else "CAST(floor({}) AS BIGINT)"
    )
    day = seconds.format("created_at / 86400")
    op.execute(
        "INSERT INTO spend (id, org_id, api_key_id, created_at, amount, settled)"
        f" SELECT id, org_id, NULL, created_at, charged, status IN {_ENDED} FROM batches"
    )
    op.execute(
        "INSERT INTO spend (id, org_id, api_key_id, created_at, amount, settled)"
        f" SELECT 'gpu_' || org_id || '_' || {day}, org_id, NULL, {day} * 86400, SUM(amount),"
        f" 1 = 1 FROM receipts WHERE kind = 'gpu_time' GROUP BY org_id, {day}"
    )
    op.execute(
        "INSERT INTO spend (id, org_id, api_key_id, created_at, amount, settled)"
        f" SELECT batch_id, MIN(org_id), NULL, {seconds.format('MIN(created_at)')},"
        " SUM(amount), 1 = 1 FROM receipts r"
        " WHERE kind = 'tokens' AND batch_id IS NOT NULL"
        # NOT EXISTS, not NOT IN: an anti-join, where NOT IN over many batches is a subplan
        # per receipt on PostgreSQL.
        " AND NOT EXISTS (SELECT 1 FROM batches b WHERE b.id = r.batch_id) GROUP BY batch_id"
    )


def downgrade() -> None:
    op.drop_index("ix_spend_key", table_name="spend")
    op.drop_index("ix_spend_org", table_name="spend")
    op.drop_table("spend")
    op.drop_index("ix_spend_caps_org", table_name="spend_caps")
    op.drop_table("spend_caps")
