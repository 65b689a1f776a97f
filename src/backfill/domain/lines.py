"""Split a byte stream into numbered lines without holding more than one line in memory."""

from __future__ import annotations

from dataclasses import dataclass

from backfill.domain.input_format import Limits, LineError


@dataclass(slots=True)
class LineRef:
    """Where one request line of an accepted input file lies, and its custom_id.

    Not frozen: a batch's creation makes one per line, and a frozen dataclass's ``__init__``
    (``object.__setattr__`` per field) costs three times a plain one's."""

    idx: int
    offset: int
    length: int
    custom_id: str


class LineSplitter:
    """Feed chunks, get complete lines, numbered from 1.

    Whole chunks are split by ``bytes.split`` (the per-line work stays in C). A line keeps a
    trailing CR, which JSON treats as whitespace and the line limit does not count.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._rest = b""
        self._pending: LineError | None = None
        self.line_no = 0
        self.total = 0

    def feed_lines(self, chunk: bytes) -> tuple[int, list[bytes]]:
        """The number of the first line completed by ``chunk``, and those lines. When a line
        outgrows its limit or the file its own, the lines before it are returned and
        ``raise_pending`` raises the error: the caller checks those lines first, so an earlier
        bad line is the one reported, wherever the chunks were cut."""
        self.raise_pending()
        first = self.line_no + 1
        room = self._limits.max_file_bytes - self.total
        self.total += len(chunk)
        if len(chunk) > room:
            lines = self._split(chunk[: max(room, 0)])
            if self._pending is None:
                self._pending = LineError(
                    "file_too_large",
                    f"The file is larger than {self._limits.max_file_bytes} bytes (line "
                    f"{self.line_no + 1} crosses the limit); split it into several batches.",
                    line=self.line_no + 1,
                )
            return first, lines
        return first, self._split(chunk)

    def raise_pending(self) -> None:
        if self._pending is not None:
            raise self._pending

    def _split(self, chunk: bytes) -> list[bytes]:
        """The complete lines of ``chunk``, up to a line over the limit (its error pending)."""
        lines = (self._rest + chunk if self._rest else chunk).split(b"\n")
        rest = lines.pop()
        limit = self._limits.max_line_bytes
        if lines and max(map(len, lines)) > limit:
            for i, raw in enumerate(lines):
                if len(raw) - raw.endswith(b"\r") > limit:
                    self.line_no += i
                    self._pending = self._line_too_large(self.line_no + 1)
                    return lines[:i]
        self.line_no += len(lines)
        self._rest = rest
        # A trailing CR may belong to a CRLF ending, which does not count toward the limit;
        # a line is refused once it outgrows the limit, before its end arrives.
        if len(rest) - rest.endswith(b"\r") > limit:
            self._pending = self._line_too_large(self.line_no + 1)
        return lines

    def finish_lines(self) -> tuple[int, list[bytes]]:
        """The last line when the file does not end with a newline, numbered as ``feed_lines``
        numbers its lines."""
        self.raise_pending()
        first = self.line_no + 1
        if not self._rest:
            return first, []
        raw, self._rest = self._rest, b""
        self.line_no += 1
        return first, [raw]

    def _line_too_large(self, line_no: int) -> LineError:
        return LineError(
            "line_too_large",
            f"Line {line_no} is longer than {self._limits.max_line_bytes} bytes; shorten it or "
            "move large inputs out of the request.",
            line=line_no,
        )
