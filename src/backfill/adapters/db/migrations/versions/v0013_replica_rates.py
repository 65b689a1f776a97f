"""each model's rate per replica, and the replicas up when its measurement window started

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows written before read as 0 replicas and no rate per replica: the planner's next
    # window starts with the replicas then up, and measures the rate per replica at its end.
    with op.batch_alter_table("model_rates", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replicas", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("rps_per_replica", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_rates", schema=None) as batch_op:
        batch_op.drop_column("rps_per_replica")
        batch_op.drop_column("replicas")
