"""why batches wait: an engine's hold (a rate limit, people's load) in its health report, and
a lane's wait (credit, fair share) as the planner found it

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without defaults: no table rewrite. Rows written before have no hold and no
    # wait; workers rewrite their reports at their next heartbeat, the planner its lanes at its
    # next pass.
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("hold", sa.String(32), nullable=True))
        batch_op.add_column(sa.Column("hold_since", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("hold_until", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("hold_status", sa.Integer(), nullable=True))
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("waiting_code", sa.String(32), nullable=True))
        batch_op.add_column(sa.Column("waiting_since", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("waiting_detail", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.drop_column("waiting_detail")
        batch_op.drop_column("waiting_since")
        batch_op.drop_column("waiting_code")
    with op.batch_alter_table("engine_health", schema=None) as batch_op:
        batch_op.drop_column("hold_status")
        batch_op.drop_column("hold_until")
        batch_op.drop_column("hold_since")
        batch_op.drop_column("hold")
