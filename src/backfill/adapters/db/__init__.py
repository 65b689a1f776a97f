"""Metadata and the work queue in SQLite or PostgreSQL (SQLAlchemy Core)."""
