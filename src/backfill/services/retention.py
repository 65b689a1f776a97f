"""The janitor: deletes expired content and marks its files ``deleted`` (SPEC §10.3)."""

from __future__ import annotations

import logging

from backfill.ports import Clock, Store
from backfill.services.files import FileService

log = logging.getLogger("backfill.retention")


class Janitor:
    def __init__(self, store: Store, files: FileService, clock: Clock) -> None:
        self._store = store
        self._files = files
        self._clock = clock

    async def sweep(self, batch_size: int = 200) -> int:
        """Remove every expired file; returns how many were removed."""
        removed = 0
        while True:
            expired = await self._store.expired_files(int(self._clock.now()), batch_size)
            for record in expired:
                await self._files.remove(record)
            removed += len(expired)
            if len(expired) < batch_size:
                break
        if removed:
            log.info("janitor removed %d expired files", removed)
        return removed
