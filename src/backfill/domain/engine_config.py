"""An engine as stored for every worker to serve (docs/fleet.md, "Engines managed at run
time"): its settings as the ``[[engines]]`` table of the config file writes them, less its
API key, which is stored sealed under the master key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson


class EngineSource(StrEnum):
    # Written from a worker's config file at its start (the file wins for its names).
    FILE = "file"
    # Added or changed through the admin API or CLI.
    API = "api"


@dataclass(frozen=True, slots=True)
class StoredEngine:
    name: str
    # The engine's settings (keys of ``[[engines]]``), without ``name`` and ``api_key``.
    spec: Mapping[str, Any]
    api_key_sealed: bytes | None
    enabled: bool
    source: EngineSource
    updated_at: float

    def fingerprint(self) -> tuple[str, bytes | None, bool]:
        """What a worker compares to know whether it serves this engine as stored."""
        return (
            orjson.dumps(dict(self.spec), option=orjson.OPT_SORT_KEYS).decode(),
            self.api_key_sealed,
            self.enabled,
        )
