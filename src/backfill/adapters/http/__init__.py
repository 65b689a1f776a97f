"""The public HTTP API (FastAPI)."""
