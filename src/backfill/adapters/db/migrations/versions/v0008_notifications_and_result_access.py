"""the notification outbox, org webhook endpoints and secrets, batch webhook URLs, results
numbered in the order they were stored, batch reruns

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_secret", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("webhook_secret_previous", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("webhook_secret_rotated_at", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("notify_email", sa.String(length=320), nullable=True))
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_url", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column("results_seq", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("retry_of", sa.String(length=64), nullable=True))
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("done_seq", sa.BigInteger(), nullable=True))
        batch_op.create_index(
            "ix_items_results",
            ["batch_id", "done_seq"],
            unique=False,
            sqlite_where=sa.text("done_seq IS NOT NULL"),
            postgresql_where=sa.text("done_seq IS NOT NULL"),
        )
    # Results a running batch stored before they were numbered are numbered by line, and the
    # batch's next number follows the last line, so a reader's cursor sees them all. Ended
    # batches are read by line (the results endpoint's second part) and need nothing.
    running = "('validating', 'in_progress', 'finalizing', 'cancelling')"
    op.execute(
        "UPDATE items SET done_seq = idx + 1 WHERE result IS NOT NULL AND batch_id IN "
        f"(SELECT id FROM batches WHERE status IN {running})"
    )
    op.execute(f"UPDATE batches SET results_seq = total WHERE status IN {running}")
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_endpoints_org", ["org_id"], unique=False)
    op.create_table(
        "notifications",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("channel", sa.String(length=16), nullable=False),
        sa.Column("endpoint_id", sa.String(length=64), nullable=True),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_at", sa.Float(), nullable=False),
        sa.Column("lease_token", sa.String(length=32), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(length=300), nullable=True),
        sa.Column("last_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("delivered_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("notifications", schema=None) as batch_op:
        batch_op.create_index("ix_notifications_batch", ["batch_id"], unique=False)
        batch_op.create_index(
            "ix_notifications_due",
            ["next_at"],
            unique=False,
            sqlite_where=sa.text("state = 0"),
            postgresql_where=sa.text("state = 0"),
        )


def downgrade() -> None:
    op.drop_table("notifications")
    op.drop_table("webhook_endpoints")
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_results")
        batch_op.drop_column("done_seq")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("retry_of")
        batch_op.drop_column("results_seq")
        batch_op.drop_column("webhook_url")
    with op.batch_alter_table("orgs", schema=None) as batch_op:
        batch_op.drop_column("notify_email")
        batch_op.drop_column("webhook_secret_rotated_at")
        batch_op.drop_column("webhook_secret_previous")
        batch_op.drop_column("webhook_secret")
