"""``python -m backfill.cli``."""

from backfill.cli.main import app

app()
