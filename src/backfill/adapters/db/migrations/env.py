"""Alembic environment: runs on the connection Backfill hands it (sync side of async)."""

from __future__ import annotations

from alembic import context

from backfill.adapters.db.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `backfill db upgrade` or Store.init()")
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
