"""batch priority and pause, deadline rescue, per-org priority caps, and answers checked
against their schema

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

# The cap an org gets until an administrator sets one (domain/priority.py, DEFAULT_MAX_PRIORITY).
_DEFAULT_MAX_PRIORITY = "10"


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("paused_at", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("urgent", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(
            sa.Column("output_validation", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "max_priority", sa.Integer(), nullable=False, server_default=_DEFAULT_MAX_PRIORITY
            )
        )
    # Every chunk of a batch made before priorities existed has priority 0: rank 0.
    with op.batch_alter_table("chunks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rank", sa.Integer(), nullable=False, server_default="0"))
    op.drop_index("ix_chunks_ready", table_name="chunks")
    op.create_index(
        "ix_chunks_ready",
        "chunks",
        ["model", "org_id", "rank", "expires_at", "batch_id", "chunk"],
        unique=False,
        sqlite_where=sa.text("state = 0"),
        postgresql_where=sa.text("state = 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_chunks_ready", table_name="chunks")
    op.create_index(
        "ix_chunks_ready",
        "chunks",
        ["model", "org_id", "expires_at", "batch_id", "chunk"],
        unique=False,
        sqlite_where=sa.text("state = 0"),
        postgresql_where=sa.text("state = 0"),
    )
    with op.batch_alter_table("chunks", schema=None) as batch_op:
        batch_op.drop_column("rank")
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.drop_column("max_priority")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("output_validation")
        batch_op.drop_column("urgent")
        batch_op.drop_column("paused_at")
        batch_op.drop_column("priority")
