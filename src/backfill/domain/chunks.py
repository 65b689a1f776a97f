"""Chunks: the unit in which a batch's lines are claimed.

A chunk is a run of consecutive lines that start inside one segment of the input blob (content
is sealed in segments of ``INPUT_SEGMENT_BYTES``), at most ``CHUNK_LINES`` long. A claim hands
out lines of one chunk, so a worker reads them with one ranged read of one or two segments
instead of one read per line, and claimers of one big batch take disjoint chunks rather than
piling onto its first queued lines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from backfill.domain.lines import LineRef

# Input content is sealed in segments of this many bytes of plaintext (the blob format's
# segment); a chunk never starts a new segment part-way.
INPUT_SEGMENT_BYTES = 1024 * 1024
CHUNK_LINES = 256


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A chunk's lines; ``chunk`` is its first line's index (stable across resumed starts)."""

    chunk: int
    lines: list[LineRef]

    @property
    def end_idx(self) -> int:
        return self.lines[-1].idx + 1


class Chunker:
    """Cuts lines, fed in order, into chunks."""

    def __init__(
        self, max_lines: int = CHUNK_LINES, segment_bytes: int = INPUT_SEGMENT_BYTES
    ) -> None:
        self._max_lines = max_lines
        self._segment_bytes = segment_bytes
        self._open: list[LineRef] = []

    def feed(self, lines: Iterable[LineRef]) -> list[ChunkRef]:
        """The chunks completed by ``lines``; the last one stays open for more lines."""
        done: list[ChunkRef] = []
        for line in lines:
            if self._open and (
                len(self._open) >= self._max_lines
                or line.offset // self._segment_bytes != self._open[0].offset // self._segment_bytes
            ):
                done.append(ChunkRef(self._open[0].idx, self._open))
                self._open = []
            self._open.append(line)
        return done

    def close(self) -> list[ChunkRef]:
        done = [ChunkRef(self._open[0].idx, self._open)] if self._open else []
        self._open = []
        return done


async def chunked(
    pages: AsyncIterator[list[LineRef]], max_lines: int = CHUNK_LINES
) -> AsyncIterator[list[ChunkRef]]:
    """Pages of lines in index order → pages of whole chunks."""
    chunker = Chunker(max_lines)
    async for page in pages:
        done = chunker.feed(page)
        if done:
            yield done
    last = chunker.close()
    if last:
        yield last
