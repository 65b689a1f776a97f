"""when each result was stored, for a batch's progress over time; an index of failed lines

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: no table rewrite on either database. Results stored
    # before keep null, and a batch with such results has no progress curve (not a wrong one).
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("done_at", sa.Float(), nullable=True))
        # The count of a batch's error codes reads its failed lines only (outcome 2 = error).
        batch_op.create_index(
            "ix_items_failed",
            ["batch_id", "idx"],
            unique=False,
            sqlite_where=sa.text("outcome = 2"),
            postgresql_where=sa.text("outcome = 2"),
        )


def downgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_failed")
        batch_op.drop_column("done_at")
