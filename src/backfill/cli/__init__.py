"""The ``backfill`` command."""
