"""Backfill: a self-hostable, OpenAI-compatible Batch inference service."""

__version__ = "0.1.0"
