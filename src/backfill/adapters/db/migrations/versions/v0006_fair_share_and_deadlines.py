"""weighted fair share (org weights, lane virtual time), deadline urgency, measured throughput,
batch completion estimates

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# scheduling/planning.py NOT_URGENT, written out: a revision must not change when the code does.
_NOT_URGENT = str(2**62)


def upgrade() -> None:
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Integer(), server_default="1", nullable=False))
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("estimated_completion_at", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("vtime", sa.Float(), server_default="0", nullable=False))
        batch_op.add_column(
            sa.Column("urgent_by", sa.BigInteger(), server_default=_NOT_URGENT, nullable=False)
        )
        batch_op.add_column(
            sa.Column("served_mark", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("share", sa.Float(), server_default="0", nullable=False))
        batch_op.drop_index("ix_lanes_turn")
        batch_op.create_index(
            "ix_lanes_turn",
            ["model", "urgent_by", "vtime"],
            unique=False,
            sqlite_where=sa.text("ready > 0"),
            postgresql_where=sa.text("ready > 0"),
        )
    op.create_table(
        "model_rates",
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("rps", sa.Float(), nullable=True),
        sa.Column("observed_at", sa.Float(), nullable=False),
        sa.Column("served", sa.BigInteger(), nullable=False),
        sa.Column("busy", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("model"),
    )
    # Every org weighed 1 until now: a lane's virtual time is what it was served, and the
    # planner's first pass measures from here.
    op.execute("UPDATE lanes SET vtime = served, served_mark = served")


def downgrade() -> None:
    op.drop_table("model_rates")
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.drop_index("ix_lanes_turn")
        batch_op.create_index(
            "ix_lanes_turn",
            ["model", "served"],
            unique=False,
            sqlite_where=sa.text("ready > 0"),
            postgresql_where=sa.text("ready > 0"),
        )
        batch_op.drop_column("share")
        batch_op.drop_column("served_mark")
        batch_op.drop_column("urgent_by")
        batch_op.drop_column("vtime")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("estimated_completion_at")
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.drop_column("weight")
