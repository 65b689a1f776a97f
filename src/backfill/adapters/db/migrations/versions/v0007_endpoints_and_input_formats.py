"""the batch endpoints each model serves; the format an input file was uploaded in

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# domain/endpoints.py DEFAULT_MODEL_ENDPOINTS and domain/files.py InputFormat.JSONL, written
# out: a revision must not change when the code does.
_DEFAULT_ENDPOINTS = "/v1/chat/completions,/v1/completions"
_JSONL = "jsonl"


def upgrade() -> None:
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "endpoints",
                sa.String(length=200),
                server_default=_DEFAULT_ENDPOINTS,
                nullable=False,
            )
        )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("input_format", sa.String(length=32), server_default=_JSONL, nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("input_format")
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_column("endpoints")
