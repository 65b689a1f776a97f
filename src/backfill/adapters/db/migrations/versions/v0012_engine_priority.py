"""whether each engine applies the request priority Backfill sends, as its probe found

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: no table rewrite. Rows written before read as not
    # known, and every worker rewrites its rows at its next heartbeat anyway.
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.drop_column("priority")
