"""Serving a file's content: conditional requests, one byte range (RFC 9110), and content that
is opened and authenticated before the status line goes out.

Once a 200 and its Content-Length are sent, a failure can only drop the connection, which
clients read as a network error and retry forever. So the blob's header, its size and the
first segment to be sent are checked first; damage then answers an error envelope.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response, StreamingResponse

from backfill.adapters.http.envelope import error_response
from backfill.domain.files import FileRecord, content_key
from backfill.errors import ContentUnreadable
from backfill.services.files import FileService

MEDIA_TYPE = "application/jsonl"


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
    first, rest = await _opened(files, record, start, end)
    if head:
        await _discard(rest)
        return Response(status_code=status, headers=headers, media_type=MEDIA_TYPE)
    return StreamingResponse(
        _resume(first, rest), status_code=status, media_type=MEDIA_TYPE, headers=headers
    )


async def _opened(
    files: FileService, record: FileRecord, start: int, end: int
) -> tuple[bytes | None, AsyncIterator[bytes]]:
    """The first chunk of ``[start, end)``, decrypted, and the stream of the rest; raises
    before any byte is sent when the blob is missing, damaged, or not its record's size."""
    stored = await files.blobs.size(content_key(record.id))
    if stored != record.bytes:
        raise ContentUnreadable(
            f"The stored content of file {record.id!r} has {stored} bytes, not the "
            f"{record.bytes} its record says; it cannot be served."
        )
    chunks = files.content(record, start, end)
    return await anext(chunks, None), chunks


async def _resume(first: bytes | None, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


async def _discard(rest: AsyncIterator[bytes]) -> None:
    # Close the stream now rather than leaving a suspended generator to the GC.
    aclose = getattr(rest, "aclose", None)
    if aclose is not None:
        await aclose()
