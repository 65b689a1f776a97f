"""Split a byte stream into numbered lines without holding more than one line in memory."""

from __future__ import annotations

from collections.abc import Iterator

from backfill.domain.input_format import Limits, LineError


class LineSplitter:
    """Feed chunks; get ``(line_no, offset, raw)`` for every complete line.

    ``offset`` is where the line starts in the file; ``raw`` excludes the newline.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._buffer = bytearray()
        self._buffer_offset = 0
        self._line_no = 0
        self.total = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, int, bytes]]:
        room = self._limits.max_file_bytes - self.total
        self.total += len(chunk)
        if len(chunk) > room:
            # Lines that end before the limit are still checked (a bad one is reported first);
            # then the line that crosses it is named.
            yield from self._split(chunk[: max(room, 0)])
            raise LineError(
                "file_too_large",
                f"The file is larger than {self._limits.max_file_bytes} bytes (line "
                f"{self._line_no + 1} crosses the limit); split it into several batches.",
                line=self._line_no + 1,
            )
        yield from self._split(chunk)

    def _split(self, chunk: bytes) -> Iterator[tuple[int, int, bytes]]:
        self._buffer += chunk
        start = 0
        buf = self._buffer
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            yield from self._emit(bytes(buf[start:end]), self._buffer_offset + start)
            start = end + 1
        del buf[:start]
        self._buffer_offset += start
        # A trailing "\r" may belong to a CRLF ending, which does not count toward the limit.
        pending = len(buf) - (1 if buf.endswith(b"\r") else 0)
        if pending > self._limits.max_line_bytes:
            self._line_too_large(self._line_no + 1)

    def finish(self) -> Iterator[tuple[int, int, bytes]]:
        if self._buffer:
            yield from self._emit(bytes(self._buffer), self._buffer_offset)
            self._buffer_offset += len(self._buffer)
            self._buffer.clear()

    def _emit(self, raw: bytes, offset: int) -> Iterator[tuple[int, int, bytes]]:
        self._line_no += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) > self._limits.max_line_bytes:
            self._line_too_large(self._line_no)
        yield self._line_no, offset, raw

    def _line_too_large(self, line_no: int) -> None:
        raise LineError(
            "line_too_large",
            f"Line {line_no} is longer than {self._limits.max_line_bytes} bytes; shorten it or "
            "move large inputs out of the request.",
            line=line_no,
        )
