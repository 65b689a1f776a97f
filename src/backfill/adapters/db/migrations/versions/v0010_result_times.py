"""when each result was stored, for a batch's progress over time

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


def downgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_column("done_at")
