"""how long each engine's starts on demand take, as its worker learnt

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: no table rewrite. Rows written before read as not
    # measured, and every worker rewrites its rows at its next heartbeat anyway.
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("start_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.drop_column("start_s")
