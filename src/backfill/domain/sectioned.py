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

import re
from collections.abc import Iterator
from dataclasses import dataclass

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
_MESSAGE_INDEX = re.compile(r"body\.messages\[(\d+)\](.*)")
_CHAT = msgspec.Raw(msgspec.json.encode(CHAT_URL))


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the parts of an expanded request came from, to name them in an error."""

    section_line: int
    prefix: int
    """How many of its messages are the section's prefix messages."""
    shared: frozenset[str]
    """The body fields it takes from its section (not overridden by its own)."""

    def attribute(self, error: LineError) -> LineError:
        """``error``, found in the expanded request, said of the line and field the user wrote:
        a section's shared field or prefix message is the section line's; a request's own
        message keeps its own index."""
        param = error.param
        if param is None or not param.startswith("body."):
            return error
        line, new = error.line, param
        field = re.split(r"[.\[]", param[5:], maxsplit=1)[0]
        index = _MESSAGE_INDEX.match(param)
        if index is not None:
            i = int(index.group(1))
            if i < self.prefix:
                line, new = self.section_line, f"section.messages[{i}]{index.group(2)}"
            else:
                new = f"body.messages[{i - self.prefix}]{index.group(2)}"
        elif field == "messages" and self.prefix:
            line, new = self.section_line, "section.messages"
        elif field in self.shared:
            line, new = self.section_line, f"section.{param}"
        if new == param:
            return error
        message = error.message.replace(f"Line {error.line}", f"Line {line}", 1)
        return LineError(error.code, message.replace(f"'{param}", f"'{new}"), line=line, param=new)


def is_sectioned(first_line: bytes) -> bool:
    """Whether a file whose first line is ``first_line`` is a sectioned file (the line names
    a format; plain request lines never have that key)."""
    return "format" in (_keys(first_line) or ())


class SectionedExpander:
    """Feed the file's lines in order; get back its requests as plain lines."""

    def __init__(self) -> None:
        self._header_seen = False
        self._section: _Section | None = None
        self._ids: set[str] = set()
        self._section_line = 0
        self._section_requests = 0
        self.requests = 0

    def expand(
        self, lines: list[bytes], first_line_no: int
    ) -> Iterator[tuple[int, int, bytes, Origin]]:
        """Each request among consecutive ``lines`` (the first numbered ``first_line_no``): its
        line number, its number among the file's requests, its plain line and its origin."""
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
            self._section_requests += 1
            shared = frozenset(self._section.body.keys() - request.body.keys())
            origin = Origin(self._section_line, len(self._section.messages), shared)
            yield line_no, self.requests, self._merge(request, line_no), origin

    def finish(self, line_no: int) -> None:
        """The end of the file: it must have had its header, and its last section requests."""
        self._section_ends()
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
            keys = _keys(raw)
            if keys is None:
                # Too deep to read even its keys: that is the line's fault, whatever it was
                # meant to be (a section nested in itself stops at an unknown field first).
                raise undecodable(raw, line_no, RecursionError()) from None
            if "section" not in keys or "custom_id" in keys:
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
        self._section_ends()
        self._ids.add(section.id)
        self._section_line, self._section_requests = line_no, 0
        self._section = section
        return True

    def _section_ends(self) -> None:
        """A section's shared parts are checked as part of its requests: one without any
        would be accepted unchecked, and ignored."""
        if self._section is not None and not self._section_requests:
            line = self._section_line
            raise LineError(
                "invalid_value",
                f"Line {line}: section {self._section.id!r} has no requests; remove it or put "
                "its requests after it.",
                line=line,
                param="section",
            )

    def _merge(self, request: _Request, line_no: int) -> bytes:
        section = self._section
        assert section is not None
        body = {**section.body, **request.body}
        if section.messages:
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
            body["messages"] = msgspec.Raw(_ENCODE([*section.messages, *tail]))
        return _ENCODE(
            _Expanded(
                custom_id=request.custom_id,
                method=request.method or _POST,
                url=request.url or _CHAT,
                body=body,
                section=section.id,
            )
        )


def _keys(raw: bytes) -> frozenset[str] | None:
    """The keys of a line that is a JSON object (none for anything else); None when it nests
    too deeply to be read."""
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:
        return None
    except msgspec.DecodeError:
        return frozenset()
    return frozenset(value) if isinstance(value, dict) else frozenset()


_SECTION_FIELDS = "id, body and messages (inside 'section')"
_REQUEST_FIELDS = (
    'custom_id, body, and optionally method and url; a section line is {"section":{…}}'
)
