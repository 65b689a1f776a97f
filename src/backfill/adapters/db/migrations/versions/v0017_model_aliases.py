"""model aliases: every name a line may use for a model, its id and its aliases, unique

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_names",
        sa.Column("name", sa.String(256), primary_key=True),
        sa.Column("model_id", sa.String(256), sa.ForeignKey("models.id"), nullable=False),
    )
    op.create_index("ix_model_names_model", "model_names", ["model_id"])
    # Each entry already stored is known by its id: no alias can take it from now on.
    op.execute("INSERT INTO model_names (name, model_id) SELECT id, id FROM models")


def downgrade() -> None:
    op.drop_index("ix_model_names_model", table_name="model_names")
    op.drop_table("model_names")
