"""the webhook secret replaced before the previous one, so each keeps its grace

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns: no table rewrite, and an org's previous secret stays where it was.
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_secret_older", sa.LargeBinary(), nullable=True))
        batch_op.add_column(
            sa.Column("webhook_secret_older_rotated_at", sa.BigInteger(), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.drop_column("webhook_secret_older_rotated_at")
        batch_op.drop_column("webhook_secret_older")
