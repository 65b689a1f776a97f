"""Schema migrations with Alembic, run on SQLite and PostgreSQL alike."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade(connection: Connection) -> None:
    command.upgrade(alembic_config(connection), "head")


def revision(connection: Connection, message: str) -> None:
    """Autogenerate a revision from the difference between ``tables.py`` and the database."""
    command.revision(alembic_config(connection), message=message, autogenerate=True)
