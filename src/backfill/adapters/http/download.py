"""Serving a file's content: conditional requests, one byte range (RFC 9110), and content that
is opened and authenticated before the status line goes out.

Once a 200 and its Content-Length are sent, a failure can only drop the connection. So the
blob's header and size, and every segment of the requested span up to
``VERIFY_BEFORE_STATUS_BYTES`` (always at least the first), are authenticated first: damage
there answers an error envelope. Past that, each segment is authenticated before any of its
bytes are sent, and one that fails ends the response unfinished (``_Body``): the connection
drops short of the Content-Length, which every HTTP client reports as an error, and no byte
that failed its check is ever sent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from backfill.adapters.http.envelope import error_response
from backfill.domain.files import FileRecord
from backfill.errors import ContentUnreadable, StorageError
from backfill.services.files import FileService

MEDIA_TYPE = "application/jsonl"

# Spans up to this long are authenticated whole before the status line, so damage anywhere in
# them is an envelope rather than a dropped connection. It costs a first pass over those
# segments, which the blob store's segment cache (16 MiB) then usually serves to the second, and
# no memory of its own; a longer span would delay its first byte by a pass over all of it.
VERIFY_BEFORE_STATUS_BYTES = 8 * 1024 * 1024

log = logging.getLogger("backfill.api")


@dataclass(frozen=True, slots=True)
class Unsatisfiable:
    """A syntactically valid range that starts at or past the end of the content."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | Unsatisfiable | None:
    """``[start, end)`` of a single ``bytes=`` range, ``Unsatisfiable``, or None to send all.

    Malformed and multi-range headers are ignored (RFC 9110 lets a server do that), and so is
    every range of an empty file: no Content-Range can describe a part of zero bytes.
    """
    if not header or not header.startswith("bytes=") or size == 0:
        return None
    spec = header.removeprefix("bytes=").strip()
    if "," in spec:
        return None
    first, _, last = spec.partition("-")
    if not _digits(first) and not (first == "" and _digits(last)):
        return None
    if last and not _digits(last):
        return None
    if first == "":
        length = int(last)
        return (max(0, size - length), size) if length > 0 else None
    start = int(first)
    if last and int(last) < start:
        return None  # "5-2" is invalid, not unsatisfiable
    if start >= size:
        return Unsatisfiable()
    end = int(last) + 1 if last else size
    return start, min(end, size)


def _digits(text: str) -> bool:
    # int() would also take "+5", " 5", "1_0" and non-ASCII digits, which RFC 9110 does not.
    return text.isascii() and text.isdigit()


def none_match(header: str | None, etag: str) -> bool:
    """Whether ``If-None-Match`` matches ``etag``: ``*``, or a list compared weakly."""
    if header is None:
        return False
    if header.strip() == "*":
        return True
    return any(_opaque(tag) == _opaque(etag) for tag in header.split(","))


def _opaque(tag: str) -> str:
    return tag.strip().removeprefix("W/")


async def file_content(
    files: FileService,
    record: FileRecord,
    *,
    head: bool,
    range_: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> Response:
    etag = f'"{record.id}"'
    headers = {"ETag": etag, "Accept-Ranges": "bytes"}
    if none_match(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    span = parse_range(range_, record.bytes)
    if span is not None and if_range is not None and if_range != etag:
        span = None  # If-Range compares strongly; on a mismatch the whole file is sent
    if isinstance(span, Unsatisfiable):
        return error_response(
            416,
            f"The range {range_!r} starts at or past the end of the file "
            f"({record.bytes} bytes); ranges start at 0 to {record.bytes - 1}.",
            type_="invalid_request_error",
            code="range_not_satisfiable",
            param="Range",
            headers={**headers, "Content-Range": f"bytes */{record.bytes}"},
        )
    status = 200
    start, end = 0, record.bytes
    if span is not None:
        status = 206
        start, end = span
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{record.bytes}"
    headers["Content-Length"] = str(end - start)
    # HEAD answers what GET would: the same checks run before its status line.
    first, rest = await _opened(files, record, start, end)
    if head:
        await _discard(rest)
        return Response(status_code=status, headers=headers, media_type=MEDIA_TYPE)
    return _Body(record.id, end - start, first, rest, status_code=status, headers=headers)


async def _opened(
    files: FileService, record: FileRecord, start: int, end: int
) -> tuple[bytes | None, AsyncIterator[bytes]]:
    """The first chunk of ``[start, end)``, decrypted, and the stream of the rest; raises
    before any byte is sent when the blob is missing, not its record's size, or damaged in its
    header, its first segment, or any segment of a span up to VERIFY_BEFORE_STATUS_BYTES."""
    await files.check_stored_size(record)
    if end - start <= VERIFY_BEFORE_STATUS_BYTES:
        verify = files.content(record, start, end)
        try:
            async for _ in verify:
                pass  # each segment is authenticated as it is decrypted
        finally:
            await _discard(verify)
    chunks = files.content(record, start, end)
    try:
        return await anext(chunks, None), chunks
    except BaseException:
        await _discard(chunks)
        raise


class _Body(StreamingResponse):
    """The authenticated chunks of a span, the first already read. A chunk that cannot be read
    once the status line is out (damage past what was checked first, or storage going away)
    ends the response without its last message: the server then closes the connection short
    of the Content-Length, so no client takes the cut body for a whole one."""

    def __init__(
        self,
        file_id: str,
        length: int,
        first: bytes | None,
        rest: AsyncIterator[bytes],
        *,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(rest, status_code=status_code, media_type=MEDIA_TYPE, headers=headers)
        self._file_id = file_id
        self._length = length
        self._first = first
        self._rest = rest

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        sent = 0
        chunk = self._first
        try:
            while chunk is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
                try:
                    chunk = await anext(self._rest, None)
                except StorageError as exc:
                    self._cut(sent, exc)
                    return
        finally:
            await _discard(self._rest)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _cut(self, sent: int, exc: StorageError) -> None:
        # Damage itself was logged and counted where it was found (with its kind); this line
        # says which download it cut, and where. Ids and sizes only, never content.
        damaged = isinstance(exc, ContentUnreadable)
        log.log(
            logging.ERROR if damaged else logging.WARNING,
            "download of file %s cut after %d of %d bytes: %s; the connection is dropped so "
            "the client sees an incomplete response",
            self._file_id,
            sent,
            self._length,
            "stored content damaged" if damaged else "storage unavailable",
        )


async def _discard(rest: AsyncIterator[bytes]) -> None:
    # Close the stream now rather than leaving a suspended generator to the GC.
    aclose = getattr(rest, "aclose", None)
    if aclose is not None:
        await aclose()
