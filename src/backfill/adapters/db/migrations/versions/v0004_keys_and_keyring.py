"""key revocation and the master key check

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("name", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("revoked_at", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.BigInteger(), nullable=True))
    op.create_table(
        "keyring",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("check_value", sa.String(length=128), nullable=False),
        sa.Column("min_blob_format", sa.SmallInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("keyring")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("revoked_at")
        batch_op.drop_column("name")
