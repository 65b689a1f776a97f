"""A claimed request and its input: the lines of a claim are read with one ranged read for all
of them, not one per line."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from backfill.domain.files import content_key
from backfill.domain.records import Claim, ClaimedItem, WorkBatch
from backfill.ports import BlobStore


class ClaimInput:
    """The bytes of a claim's lines (one chunk, so one or two sealed segments of the input),
    read once, the first time one of its requests needs its line. A failed read fails each of
    them alike, so each is handled like any other storage failure of its own."""

    def __init__(self, blobs: BlobStore, claim: Claim) -> None:
        self._blobs = blobs
        self._key = content_key(claim.batch.input_file_id)
        self._start = min(item.offset for item in claim.items)
        self._end = max(item.offset + item.length for item in claim.items)
        self._read: asyncio.Future[bytes] | None = None

    def read_soon(self) -> asyncio.Future[bytes]:
        """Start the read (once); its future."""
        if self._read is None:
            self._read = asyncio.ensure_future(self._blobs.read(self._key, self._start, self._end))
            # Retrieved here too, so a read whose requests were all dropped logs nothing.
            self._read.add_done_callback(_retrieve)
        return self._read

    async def line(self, item: ClaimedItem) -> bytes:
        # Shielded: one request cancelled must not cancel the read its siblings wait on.
        data = await asyncio.shield(self.read_soon())
        start = item.offset - self._start
        return data[start : start + item.length]


def _retrieve(read: asyncio.Future[bytes]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        read.exception()


@dataclass(frozen=True, slots=True)
class Queued:
    """A claimed request waiting for a free slot of its engine; ``body``, when set, is what
    its engine is sent (decoded before the slot, its remote images already inline)."""

    batch: WorkBatch
    item: ClaimedItem
    input: ClaimInput
    body: dict[str, Any] | None = None
