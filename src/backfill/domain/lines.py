"""Split a byte stream into numbered lines without holding more than one line in memory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from backfill.domain.input_format import Limits, LineError


@dataclass(frozen=True, slots=True)
class LineRef:
    """Where one request line of an accepted input file lies, and its custom_id."""

    idx: int
    offset: int
    length: int
    custom_id: str


class LineSplitter:
    """Feed chunks, get complete lines.

    ``feed_lines`` is the fast path: whole chunks are split by ``bytes.split`` (the per-line
    work stays in C) and lines keep a trailing CR, which JSON treats as whitespace. Lines are
    numbered consecutively: the first line ``feed_lines`` returns is ``line_no - len(lines) + 1``.
    ``feed`` yields ``(line_no, offset, raw)`` with the CR removed, for callers that want that.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._rest = b""
        self._offset = 0
        self._pending: LineError | None = None
        self.line_no = 0
        self.total = 0

    def feed_lines(self, chunk: bytes) -> list[bytes]:
        """Complete lines so far. When the file crosses its size limit, the lines before the
        limit are returned and ``raise_pending`` raises the error (so an earlier bad line is
        reported first)."""
        self.raise_pending()
        room = self._limits.max_file_bytes - self.total
        self.total += len(chunk)
        if len(chunk) > room:
            lines = self._split(chunk[: max(room, 0)])
            self._pending = LineError(
                "file_too_large",
                f"The file is larger than {self._limits.max_file_bytes} bytes (line "
                f"{self.line_no + 1} crosses the limit); split it into several batches.",
                line=self.line_no + 1,
            )
            return lines
        return self._split(chunk)

    def raise_pending(self) -> None:
        if self._pending is not None:
            raise self._pending

    def _split(self, chunk: bytes) -> list[bytes]:
        lines = (self._rest + chunk if self._rest else chunk).split(b"\n")
        rest = lines.pop()
        limit = self._limits.max_line_bytes
        if lines and max(map(len, lines)) > limit:
            for i, raw in enumerate(lines):
                if len(raw) - raw.endswith(b"\r") > limit:
                    self.line_no += i
                    self._line_too_large(self.line_no + 1)
        self.line_no += len(lines)
        self._rest = rest
        # A trailing CR may belong to a CRLF ending, which does not count toward the limit.
        if len(rest) - rest.endswith(b"\r") > limit:
            self._line_too_large(self.line_no + 1)
        return lines

    def finish_lines(self) -> list[bytes]:
        """The last line when the file does not end with a newline."""
        self.raise_pending()
        if not self._rest:
            return []
        raw, self._rest = self._rest, b""
        self.line_no += 1
        return [raw]

    def feed(self, chunk: bytes) -> Iterator[tuple[int, int, bytes]]:
        yield from self._numbered(self.feed_lines(chunk))
        self.raise_pending()

    def finish(self) -> Iterator[tuple[int, int, bytes]]:
        yield from self._numbered(self.finish_lines())

    def _numbered(self, lines: list[bytes]) -> Iterator[tuple[int, int, bytes]]:
        line_no = self.line_no - len(lines)
        for raw in lines:
            line_no += 1
            offset = self._offset
            self._offset += len(raw) + 1
            yield line_no, offset, raw[:-1] if raw.endswith(b"\r") else raw

    def _line_too_large(self, line_no: int) -> None:
        raise LineError(
            "line_too_large",
            f"Line {line_no} is longer than {self._limits.max_line_bytes} bytes; shorten it or "
            "move large inputs out of the request.",
            line=line_no,
        )
