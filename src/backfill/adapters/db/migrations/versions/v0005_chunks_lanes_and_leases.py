"""chunks and lanes as the unit of claim, the finalize lease, indexes that avoid history scans

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Lines of batches still running when this runs are cut into fixed chunks of this many lines.
_UPGRADE_CHUNK = 256


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("finalizer", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("finalize_until", sa.Float(), nullable=True))
        batch_op.drop_index("ix_batches_status")
        batch_op.create_index("ix_batches_status_expires", ["status", "expires_at"], unique=False)
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index(
            "ix_files_expiring",
            ["expires_at"],
            unique=False,
            sqlite_where=sa.text("status <> 'deleted'"),
            postgresql_where=sa.text("status <> 'deleted'"),
        )
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("chunk", sa.Integer(), nullable=True))
        batch_op.create_index(
            "ix_items_leased",
            ["lease_until"],
            unique=False,
            sqlite_where=sa.text("state = 1"),
            postgresql_where=sa.text("state = 1"),
        )
    op.create_table(
        "chunks",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("chunk", sa.Integer(), nullable=False),
        sa.Column("first_idx", sa.Integer(), nullable=False),
        sa.Column("end_idx", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("not_before", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "chunk"),
    )
    op.create_index(
        "ix_chunks_ready",
        "chunks",
        ["model", "org_id", "expires_at", "batch_id", "chunk"],
        unique=False,
        sqlite_where=sa.text("state = 0"),
        postgresql_where=sa.text("state = 0"),
    )
    op.create_table(
        "lanes",
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("metered", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("served", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("ready", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("model", "org_id"),
    )
    op.create_index(
        "ix_lanes_turn",
        "lanes",
        ["model", "served"],
        unique=False,
        sqlite_where=sa.text("ready > 0"),
        postgresql_where=sa.text("ready > 0"),
    )
    op.create_table(
        "singletons",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=32), nullable=False),
        sa.Column("until", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    _chunk_running_batches()


def _chunk_running_batches() -> None:
    """Give the lines of batches that have not ended chunks, so they keep draining."""
    live = "SELECT id FROM batches WHERE status IN ('validating', 'in_progress', 'cancelling')"
    op.execute(f"UPDATE items SET chunk = idx / {_UPGRADE_CHUNK} WHERE batch_id IN ({live})")
    op.execute(
        "INSERT INTO chunks (batch_id, chunk, first_idx, end_idx, model, org_id, expires_at, state)"
        " SELECT i.batch_id, i.chunk, min(i.idx), max(i.idx) + 1, b.model, b.org_id,"
        " b.expires_at, CASE WHEN b.status = 'in_progress' AND min(i.state) < 2 THEN 0 ELSE 1 END"
        " FROM items i JOIN batches b ON b.id = i.batch_id WHERE i.chunk IS NOT NULL"
        " GROUP BY i.batch_id, i.chunk, b.model, b.org_id, b.expires_at, b.status"
    )
    op.execute(
        "INSERT INTO lanes (model, org_id, metered, served, ready)"
        " SELECT c.model, c.org_id, b.billing = 'gpu_time', 0, sum(CASE WHEN c.state = 0"
        " THEN 1 ELSE 0 END) FROM chunks c JOIN batches b ON b.id = c.batch_id"
        " GROUP BY c.model, c.org_id, b.billing = 'gpu_time'"
    )


def downgrade() -> None:
    op.drop_table("singletons")
    op.drop_index("ix_lanes_turn", table_name="lanes")
    op.drop_table("lanes")
    op.drop_index("ix_chunks_ready", table_name="chunks")
    op.drop_table("chunks")
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_leased")
        batch_op.drop_column("chunk")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_expiring")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_status_expires")
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
        batch_op.drop_column("finalize_until")
        batch_op.drop_column("finalizer")
