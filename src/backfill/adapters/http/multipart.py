"""Stream a ``multipart/form-data`` upload: form fields are collected, the file part is passed
on chunk by chunk, so an upload of any size uses bounded memory and no temporary file."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from backfill.errors import InvalidInput

MAX_FIELD_BYTES = 64 * 1024


class _Part:
    """The form part being parsed."""

    def __init__(self) -> None:
        self.header_field = bytearray()
        self.headers: dict[bytes, bytes] = {}
        self.name = ""
        self.is_file = False
        self.value = bytearray()

    def reset(self) -> None:
        self.header_field.clear()
        self.headers.clear()
        self.name = ""
        self.is_file = False
        self.value.clear()


async def stream_form(
    content_type: str,
    body: AsyncIterator[bytes],
    on_file_chunk: Callable[[bytes], Awaitable[None]],
) -> tuple[dict[str, str], bool]:
    """Parse the form; returns its text fields and whether a ``file`` part was seen."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidInput(
            "Upload files as multipart/form-data with the fields 'purpose' and 'file'.",
            code="invalid_value",
            param="file",
        )
    fields: dict[str, str] = {}
    part = _Part()
    file_chunks: list[bytes] = []
    ended: list[bool] = []
    saw_file = False

    def on_part_begin() -> None:
        part.reset()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part.header_field += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        key = bytes(part.header_field).lower()
        part.headers[key] = part.headers.get(key, b"") + data[start:end]

    def on_header_end() -> None:
        part.header_field.clear()

    def on_headers_finished() -> None:
        nonlocal saw_file
        _, disposition = parse_options_header(part.headers.get(b"content-disposition", b""))
        part.name = disposition.get(b"name", b"").decode()
        if part.name == "file":
            if saw_file:
                # Two file parts would be stored as one file, and a proxy that inspects only the
                # first part would not see what runs.
                raise InvalidInput(
                    "The form has more than one 'file' part; upload one file per request.",
                    code="invalid_value",
                    param="file",
                )
            part.is_file = saw_file = True

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.is_file:
            file_chunks.append(data[start:end])
            return
        part.value += data[start:end]
        if len(part.value) > MAX_FIELD_BYTES:
            raise InvalidInput(
                f"Form field {part.name!r} is too long.", code="invalid_value", param=part.name
            )

    def on_part_end() -> None:
        if not part.is_file and part.name:
            fields[part.name] = part.value.decode(errors="replace")

    def on_end() -> None:
        ended.append(True)

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_end": on_end,
        },
    )
    try:
        async for chunk in body:
            parser.write(chunk)
            if file_chunks:
                joined = b"".join(file_chunks)
                file_chunks.clear()
                await on_file_chunk(joined)
        parser.finalize()
    except MultipartParseError as exc:
        raise InvalidInput(
            f"The multipart form is malformed ({exc}); send the fields 'purpose' and 'file'.",
            code="invalid_value",
            param="file",
        ) from None
    if file_chunks:
        await on_file_chunk(b"".join(file_chunks))
    if not ended:
        # A body cut short must not be stored as a shorter, valid-looking file.
        raise InvalidInput(
            "The upload ended before the multipart form was complete; send the whole file.",
            code="invalid_value",
            param="file",
        )
    return fields, saw_file
