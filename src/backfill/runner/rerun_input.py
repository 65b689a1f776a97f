"""The rerun input a finalize writes beside the error file: the request lines, read from the
batch's input, of every line that did not succeed (``domain/reruns.py``).

Lines arrive a page of results at a time, in input order; neighbouring lines are read with
one ranged read (only the segments they touch decrypt) and spans are capped, so memory stays
bounded by the span cap or one line, whatever the batch's size.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from backfill.errors import ContentUnreadable, NotFound
from backfill.ports import BlobStore, BlobWriter

log = logging.getLogger("backfill.finalize")

# Lines closer than this are read together: a read decrypts whole 1 MiB segments anyway.
_GAP_BYTES = 1 << 20
# The most one read may span, unless a single line is longer.
_SPAN_BYTES = 8 << 20
# Pauses before the second and third tries of a read that met a passing fault.
_READ_PAUSES_S = (0.2, 1.0)

Line = tuple[int, int]
"""Where a request line starts in the input, and its length (without its newline)."""


def spans(lines: Sequence[Line]) -> Iterator[tuple[int, int, list[Line]]]:
    """Group ``lines`` (in input order) into reads: (start, end, the lines inside)."""
    group: list[Line] = []
    start = end = 0
    for offset, length in lines:
        if length <= 0:
            continue  # nothing to rerun: a store that does not know where the line is
        if group and (offset - end > _GAP_BYTES or offset + length - start > _SPAN_BYTES):
            yield start, end, group
            group = []
        if not group:
            start = offset
        group.append((offset, length))
        end = max(end, offset + length)
    if group:
        yield start, end, group


class RerunInput:
    """Writes the rerun input to ``key`` from the input blob ``source``. The blob is created
    at the first line read, so a batch whose lines all succeeded has none.

    The rerun input must never keep a batch from ending (a cancel ends within seconds, also
    while storage fails): input that cannot be read — missing or damaged at once, a passing
    fault after a few quick tries — gives the rerun input up, not the finalize. A retry of
    the batch then says its lines were not kept.
    """

    def __init__(self, blobs: BlobStore, source: str, key: str) -> None:
        self._blobs = blobs
        self._source = source
        self._key = key
        self._writer: BlobWriter | None = None
        self._given_up = False

    async def add(self, lines: Sequence[Line]) -> None:
        for start, end, group in spans(lines):
            if self._given_up:
                return
            data = await self._read(start, end)
            if data is None:
                await self.abort()
                self._given_up = True
                return
            if self._writer is None:
                self._writer = await self._blobs.writer(self._key)
            out = bytearray()
            for offset, length in group:
                out += data[offset - start : offset - start + length]
                out += b"\n"
            await self._writer.write(bytes(out))

    async def _read(self, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the input; None once it is clear they cannot be read."""
        pauses = iter(_READ_PAUSES_S)
        while True:
            try:
                return await self._blobs.read(self._source, start, end)
            except (ContentUnreadable, NotFound) as exc:
                failure: Exception = exc
            except Exception as exc:
                pause = next(pauses, None)
                if pause is not None:
                    await asyncio.sleep(pause)
                    continue
                failure = exc
            log.warning(
                "no rerun input is kept: its input %s cannot be read (%s)",
                self._source,
                type(failure).__name__,
            )
            return None

    async def commit(self) -> bool:
        """Make the rerun input visible; False when there is none."""
        if self._writer is None:
            return False
        await self._writer.commit()
        return True

    async def abort(self) -> None:
        if self._writer is not None:
            await self._writer.abort()
            self._writer = None
