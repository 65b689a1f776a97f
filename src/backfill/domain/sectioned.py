"""BatchRouter sectioned JSONL (SPEC §8.1), expanded into plain request lines as it streams in.

A file is a header line ``{"format":"batchrouter.sectioned.v1"}``, then sections: a section
line ``{"section":{"id":…,"body":{shared fields},"messages":[prefix messages]}}`` followed by
its request lines ``{"custom_id":…,"body":{…}}`` (``method`` and ``url`` optional). A request's
body is the section's body overridden by its own fields; its messages are the section's prefix
messages followed by its own. Each request becomes the plain line it stands for, carrying its
section's id as ``section`` (the dispatcher's locality hint), and is then validated exactly as
a plain line is: a sectioned batch is the plain batch of its expanded requests.

Only one section is held at a time; field values stay the raw JSON the user wrote
(``msgspec.Raw``), so expanding re-encodes no message or parameter.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from backfill.domain.endpoints import CHAT_URL
from backfill.domain.input_format import MAX_SECTION_ID_BYTES, LineError, undecodable

FORMAT = "batchrouter.sectioned.v1"


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    format: str


class _Section(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    body: dict[str, msgspec.Raw] = {}
    messages: list[msgspec.Raw] = []


class _SectionLine(msgspec.Struct, forbid_unknown_fields=True):
    section: _Section


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: msgspec.Raw
    body: dict[str, msgspec.Raw]
    # Raw cannot be part of a union: an empty Raw stands for an absent field.
    method: msgspec.Raw = msgspec.Raw()
    url: msgspec.Raw = msgspec.Raw()


class _Expanded(msgspec.Struct):
    custom_id: msgspec.Raw
    method: msgspec.Raw
    url: msgspec.Raw
    body: dict[str, msgspec.Raw]
    section: str


_HEADER = msgspec.json.Decoder(_Header)
_SECTION = msgspec.json.Decoder(_SectionLine)
_REQUEST = msgspec.json.Decoder(_Request)
_MESSAGES = msgspec.json.Decoder(list[msgspec.Raw])
_ENCODE = msgspec.json.Encoder().encode
_POST = msgspec.Raw(b'"POST"')
_CHAT = msgspec.Raw(msgspec.json.encode(CHAT_URL))


def is_sectioned(first_line: bytes) -> bool:
    """Whether a file whose first line is ``first_line`` is a sectioned file (the line names
    a format; plain request lines never have that key)."""
    return _has_key(first_line, "format")


class SectionedExpander:
    """Feed the file's lines in order; get back its requests as plain lines."""

    def __init__(self) -> None:
        self._header_seen = False
        self._section: _Section | None = None
        self._section_id = ""
        self._prefix: list[msgspec.Raw] = []
        self._ids: set[str] = set()
        self.requests = 0

    def expand(self, lines: list[bytes], first_line_no: int) -> Iterator[tuple[int, int, bytes]]:
        """Each request among consecutive ``lines`` (the first numbered ``first_line_no``): its
        line number, its number among the file's requests, and its plain line."""
        line_no = first_line_no - 1
        for raw in lines:
            line_no += 1
            if not self._header_seen:
                self._header(raw, line_no)
                continue
            # A request line is far more common than a section line: it is tried first.
            try:
                request = _REQUEST.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
                if self._try_section(raw, line_no):
                    continue
                raise undecodable(raw, line_no, exc, _REQUEST_FIELDS) from None
            if self._section is None:
                raise LineError(
                    "invalid_json_line",
                    f"Line {line_no}: a request line must follow a section line "
                    '({"section":{"id":…,"body":{…},"messages":[…]}}).',
                    line=line_no,
                )
            self.requests += 1
            yield line_no, self.requests, self._merge(request, line_no)

    def finish(self, line_no: int) -> None:
        """The end of the file: it must have had its header."""
        if not self._header_seen:
            raise LineError(
                "invalid_json_line",
                f'Line {line_no}: a sectioned file starts with {{"format":"{FORMAT}"}}.',
                line=line_no,
            )

    def _header(self, raw: bytes, line_no: int) -> None:
        try:
            header = _HEADER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            header = None
        if header is None or header.format != FORMAT:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: the only sectioned format is {FORMAT!r}; the first line must "
                f'be {{"format":"{FORMAT}"}}.',
                line=line_no,
                param="format",
            )
        self._header_seen = True

    def _try_section(self, raw: bytes, line_no: int) -> bool:
        """Take ``raw`` as the next section if it is a section line (False if it is not one)."""
        try:
            line = _SECTION.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            if not _has_key(raw, "section"):
                return False
            raise undecodable(raw, line_no, exc, _SECTION_FIELDS) from None
        section = line.section
        size = len(section.id.encode())
        if not 0 < size <= MAX_SECTION_ID_BYTES:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'section.id' must be 1 to {MAX_SECTION_ID_BYTES} bytes of "
                f"UTF-8 (it is {size}).",
                line=line_no,
                param="section.id",
            )
        if section.id in self._ids:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: section id {section.id!r} is used by an earlier section; each "
                "section needs its own.",
                line=line_no,
                param="section.id",
            )
        if "messages" in section.body:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'section.body.messages' is not allowed; put a section's prefix "
                "messages in 'section.messages'.",
                line=line_no,
                param="section.body.messages",
            )
        self._ids.add(section.id)
        self._section = section
        self._section_id = section.id
        self._prefix = section.messages
        return True

    def _merge(self, request: _Request, line_no: int) -> bytes:
        section = self._section
        assert section is not None
        body = {**section.body, **request.body}
        if self._prefix:
            own = request.body.get("messages")
            try:
                tail = _MESSAGES.decode(own) if own is not None else []
            except (msgspec.ValidationError, msgspec.DecodeError):
                raise LineError(
                    "invalid_value",
                    f"Line {line_no}: 'body.messages' must be an array of messages.",
                    line=line_no,
                    param="body.messages",
                ) from None
            body["messages"] = msgspec.Raw(_ENCODE([*self._prefix, *tail]))
        return _ENCODE(
            _Expanded(
                custom_id=request.custom_id,
                method=request.method or _POST,
                url=request.url or _CHAT,
                body=body,
                section=self._section_id,
            )
        )


def _has_key(raw: bytes, key: str) -> bool:
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return False
    return isinstance(value, dict) and key in value


_SECTION_FIELDS = "id, body and messages (inside 'section')"
_REQUEST_FIELDS = (
    'custom_id, body, and optionally method and url; a section line is {"section":{…}}'
)
