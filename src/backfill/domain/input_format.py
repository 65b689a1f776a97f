"""The rules of one batch input line (SPEC §5), applied line by line as an upload streams in.

Lines are decoded into typed ``msgspec`` structs: that one pass both parses and type-checks, so
the per-line Python work left is a handful of comparisons.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

import msgspec

from backfill.domain.catalog import CatalogModel
from backfill.domain.custom_ids import CustomIds
from backfill.domain.decode_errors import Broken, explain
from backfill.domain.endpoints import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    ENDPOINTS,
    RESPONSES_URL,
)
from backfill.domain.media import (
    LineMedia,
    MediaError,
    MediaLimits,
    check_audio,
    check_image_url,
)
from backfill.domain.output_schema import format_param, schema_of, schema_problem
from backfill.domain.strict_lines import Role, StrictChatLine, chat_run, strict_chat_decoder

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "ENDPOINTS"]

ROLES = frozenset(get_args(Role))
MAX_CUSTOM_ID_BYTES = 128
# The fast path (``chat_run``) checks a section by the custom_id's limit: keep them equal.
MAX_SECTION_ID_BYTES = MAX_CUSTOM_ID_BYTES
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = frozenset({"float", "base64"})
_UNSET = msgspec.UNSET
# An absent field kept as the line's own JSON: empty.
_ABSENT = msgspec.Raw(b"")
# Where a chat part's media lives, and the modality the model must publish for it.
_CHAT_PARTS = {"image_url": "image", "input_audio": "audio"}
# Responses input items Backfill passes on: messages, their text and images (an earlier
# assistant turn's output text too). Tool calls and files are refused: their URLs and file ids
# would reach the engine unchecked.
_RESPONSE_PARTS = frozenset({"input_text", "input_image", "output_text"})
# For the same reason, tools are plain functions (a name and a JSON schema) on every endpoint:
# other types (MCP servers, file search over vector stores, web search, code containers) name
# servers, stores or data the engine would reach with nothing checking them, and batch refuses
# them, as it refuses references to an engine's stored responses and conversations (the
# 2026-12-05 review, finding L6).
TOOL_TYPES = frozenset({"function"})


class ContentPart(msgspec.Struct):
    type: str
    image_url: Any = _UNSET
    input_audio: Any = _UNSET


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class Body(msgspec.Struct):
    model: str
    messages: list[Message] | None = None
    prompt: str | list[Any] | None = None
    input: Any = _UNSET
    """Embeddings and Responses lines."""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    stream_options: Any = _UNSET
    """Only beside ``stream: true`` (engines refuse it alone), and then dropped with it."""
    background: Any = _UNSET
    encoding_format: Any = _UNSET
    dimensions: Any = _UNSET
    priority: Any = _UNSET
    """Refused: the operator's engine settings set it (docs/scheduling.md)."""
    tools: Any = _UNSET
    """Only ``TOOL_TYPES``."""
    store: Any = _UNSET
    """Only false: nothing is kept engine-side for a batch."""
    # Refused unless null: they reach stored state or web pages past the upload's checks.
    previous_response_id: Any = _UNSET
    conversation: Any = _UNSET
    web_search_options: Any = _UNSET
    # Structured output (``domain/output_schema.py``): sent to the engine as written; a
    # JSON Schema in it must be a valid one. Kept as the line's JSON, not decoded: the lines
    # of a file mostly share one, and comparing its bytes with the one checked last costs far
    # less than building its objects for every line.
    response_format: msgspec.Raw = _ABSENT
    text: msgspec.Raw = _ABSENT
    """Responses lines: ``text.format``."""


class RequestLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: Body
    section: str | None = None
    """The BatchRouter section the line came from (``domain/sectioned.py``): lines of one
    section go to the same replica, back to back (SPEC §9.5)."""


class LineError(Exception):
    """A rule broken by one line; ``line`` is 1-based."""

    def __init__(self, code: str, message: str, *, line: int, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.line = line
        self.param = param


@dataclass(frozen=True, slots=True)
class Limits:
    max_file_bytes: int
    max_lines: int
    max_line_bytes: int
    media: MediaLimits = field(default_factory=MediaLimits)
    max_expanded_bytes: int = 4 * 1024**3
    """A sectioned file's requests, expanded with their sections' shared parts."""
    ignore_stream: bool = False
    """A line's ``stream: true`` is accepted and has no effect (its result is the whole
    answer, as for any line), as some hosted batch services do; refused by default."""


@dataclass(slots=True)
class FileSummary:
    lines: int
    model: str | None
    endpoint: str | None
    prompt_token_bound: int = 0
    max_output_tokens: int = 0


class _RawBody(msgspec.Struct):
    body: dict[str, msgspec.Raw]


_BOM = b"\xef\xbb\xbf"
_DECODER = msgspec.json.Decoder(RequestLine)
_BODY = msgspec.json.Decoder(_RawBody)
_DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)
# Lines of a file the strict decoder may refuse before the file's lines skip it.
_STRICT_MISSES = 64


@functools.lru_cache(maxsize=64)
def _strict_chat(model: str, max_tokens: int) -> Callable[[bytes], StrictChatLine]:
    return strict_chat_decoder(RequestLine, Body, model, max_tokens)


_LINE_FIELDS = "custom_id, method, url and body"


def _decode_error(line_no: int, error: msgspec.ValidationError, fields: str) -> LineError:
    problem = explain(error)
    param = problem.param
    if problem.broken is Broken.MISSING:
        return LineError(
            "missing_required_parameter",
            f"Line {line_no}: missing required field '{param}'.",
            line=line_no,
            param=param,
        )
    if problem.broken is Broken.UNKNOWN:
        return LineError(
            "invalid_value",
            f"Line {line_no}: unknown field '{param}'; a line has only {fields}.",
            line=line_no,
            param=param,
        )
    if problem.broken is Broken.NOT_OBJECT:
        return LineError(
            "invalid_json_line",
            f"Line {line_no} is not a JSON object; each line must be one object with {fields}.",
            line=line_no,
        )
    where = f" in field '{param}'" if param else ""
    return LineError(
        "invalid_value", f"Line {line_no}: {problem.reason}{where}.", line=line_no, param=param
    )


def undecodable(raw: bytes, line_no: int, exc: Exception, fields: str = _LINE_FIELDS) -> LineError:
    """Why a line did not decode as the struct it should be; ``fields`` names what that struct
    has, for the messages about unknown fields and non-objects."""
    if not raw.strip():
        return LineError(
            "invalid_json_line",
            f"Line {line_no} is empty; remove blank lines (only a final newline is allowed).",
            line=line_no,
        )
    if isinstance(exc, msgspec.ValidationError):
        return _decode_error(line_no, exc, fields)
    if raw.startswith(_BOM):
        # Editors on Windows add it; msgspec only reports "invalid character (byte 0)".
        return LineError(
            "invalid_json_line",
            f"Line {line_no} starts with a UTF-8 byte order mark (BOM); save the file as "
            "UTF-8 without BOM.",
            line=line_no,
        )
    if isinstance(exc, RecursionError):
        return LineError(
            "invalid_json_line",
            f"Line {line_no} nests JSON too deeply; flatten the request body.",
            line=line_no,
        )
    return LineError(
        "invalid_json_line",
        f"Line {line_no} is not a valid JSON object ({exc}).",
        line=line_no,
    )


class LineValidator:
    """Checks the lines of one file in order; keeps what cross-line rules need."""

    def __init__(self, limits: Limits, find_model: Callable[[str], CatalogModel | None]) -> None:
        """``find_model`` finds the model a line's ``body.model`` names: by its id or by one
        of its aliases."""
        self._limits = limits
        self._find_model = find_model
        self._ids = CustomIds(limits.max_lines)
        self._model: CatalogModel | None = None
        self._model_name: str | None = None
        self._endpoint: str | None = None
        self._chat = False
        # Chat and completions lines like the ones before take the fast path; embeddings and
        # Responses lines, rarer and with more shapes, always take the detailed checks.
        self._fast = False
        # The strict decoder of the file's chat lines, once its first line has fixed the model;
        # dropped after a few lines it refuses (each of them costs a second decode).
        self._strict: Callable[[bytes], StrictChatLine] | None = None
        self._strict_misses = 0
        # The last ``response_format`` (Responses: ``text``) the detailed checks accepted, as
        # the line's JSON: a line with the same bytes needs no second look at its schema.
        self._format_ok = _ABSENT
        self.lines = 0
        self._prompt_bound = 0
        self._max_output = 0

    def check_lines(
        self, lines: list[bytes], first_line_no: int, first_request: int | None = None
    ) -> list[str]:
        """Validate consecutive lines; returns their ``custom_id``s. ``first_request`` numbers
        the first of them among the file's requests when that is not its line number (a
        sectioned file's lines also hold sections).

        The common case (a valid chat line like the ones before it) takes one decode and a few
        comparisons in ``chat_run``, a run of lines at a time; anything unusual goes through
        the detailed checks, which name the rule that was broken.
        """
        counted = (first_line_no if first_request is None else first_request) - 1
        room = self._limits.max_lines - counted
        if len(lines) > room:
            # The lines within the limit first: an earlier bad line is the one reported, however
            # the file was cut into chunks.
            self.check_lines(lines[: max(room, 0)], first_line_no, first_request)
            line_no = first_line_no + max(room, 0)
            raise LineError(
                "too_many_requests_in_file",
                f"Line {line_no}: a file holds at most {self._limits.max_lines} requests; "
                "split it into several batches.",
                line=line_no,
            )
        decode = _DECODER.decode
        known = self._ids
        known.reserve(len(lines))
        roles = ROLES
        ids: list[str] = []
        append = ids.append
        # ``ids[:settled]`` are in the table of ids. The fast path's go in together, before
        # the next line that takes the detailed checks and at the end: a duplicate among them
        # is still the first error of the page.
        settled = 0
        prompt_bound = 0
        max_output = 0
        # What the lines so far agreed on, as locals: the slow path refreshes them.
        model, model_name, endpoint, chat, fast = (
            self._model,
            self._model_name,
            self._endpoint,
            self._chat,
            self._fast,
        )
        max_tokens = model.max_output_tokens if model else 0
        context = model.context_length if model else 0
        strict = self._strict
        format_ok = self._format_ok
        i = 0
        while i < len(lines):
            if strict is not None:
                # The common chat lines, as many in a row as there are, in one call.
                stop, bound, output, missed = chat_run(
                    lines, i, strict, _DECODE_ERRORS, context, MAX_CUSTOM_ID_BYTES, ids
                )
                prompt_bound += bound
                max_output += output
                if stop == len(lines):
                    break
                i = stop
                if missed:
                    # Not the common shape (or not valid): the full decode and checks below.
                    self._strict_misses += 1
                    if self._strict_misses > _STRICT_MISSES:
                        strict = self._strict = None
            if settled < len(ids):
                self._settle(ids, settled, first_line_no)
            raw = lines[i]
            line_no = first_line_no + i
            i += 1
            try:
                req = decode(raw)
            except _DECODE_ERRORS as exc:
                raise undecodable(raw, line_no, exc) from None
            body = req.body
            cid = req.custom_id
            messages = body.messages
            limit = body.max_completion_tokens
            if limit is None:
                limit = body.max_tokens
            if (
                model is None
                or not cid
                or (len(cid) > 32 and len(cid.encode()) > MAX_CUSTOM_ID_BYTES)
                or req.method != "POST"
                or req.url != endpoint
                or body.model != model_name
                or body.stream
                or body.stream_options is not _UNSET
                or body.priority is not _UNSET
                or (body.tools is not _UNSET and not _plain_tools(body.tools))
                or (body.store is not _UNSET and body.store is not False)
                or body.previous_response_id is not _UNSET
                or body.conversation is not _UNSET
                or body.web_search_options is not _UNSET
                or (body.response_format and body.response_format != format_ok)
                or (req.section is not None and not _section_ok(req.section))
                or limit is None
                or not 0 < limit <= max_tokens
                or (messages is None if chat else body.prompt is None or not fast)
                or not known.add(cid, ids)
            ):
                model = self._check_request(req, line_no, ids)
                model_name, endpoint, chat = self._model_name, self._endpoint, self._chat
                fast = self._fast
                format_ok = self._format_ok
                max_tokens = model.max_output_tokens
                context = model.context_length
                strict = self._strict_decoder()
                limit = _output_limit(body, endpoint)
            elif chat:
                # A completions line may carry messages too: they are not read, so not checked.
                if messages:
                    for message in messages:
                        if message.role not in roles or message.content.__class__ is list:
                            self._check_messages(messages, model, line_no)
                            break
                else:
                    self._check_messages(messages, model, line_no)
            # The bound of ``chat_run``; a completions line counts as one message.
            bound = len(raw) + 8 * (len(messages) + 1 if messages else 2)
            prompt_bound += bound if bound < context else context
            max_output += limit or 0
            append(cid)
            settled = len(ids)
        if settled < len(ids):
            self._settle(ids, settled, first_line_no)
        known.keep(ids)
        self.lines = counted + len(lines)
        self._prompt_bound += prompt_bound
        self._max_output += max_output
        return ids

    def _settle(self, ids: list[str], start: int, first_line_no: int) -> None:
        """Put ``ids[start:]`` in the table of ids; ``ids[k]`` is line ``first_line_no + k``'s."""
        i = self._ids.add_page(ids, start)
        if i < len(ids):
            raise _duplicate(ids[i], first_line_no + i)

    def _strict_decoder(self) -> Callable[[bytes], StrictChatLine] | None:
        model, name = self._model, self._model_name
        if (
            self._strict is None
            and self._chat
            and model is not None
            and name is not None
            and self._strict_misses <= _STRICT_MISSES
        ):
            self._strict = _strict_chat(name, model.max_output_tokens)
        return self._strict

    def _check_request(self, req: RequestLine, line_no: int, pending: list[str]) -> CatalogModel:
        """The checks that name the rule a line breaks; ``pending`` holds the ids of the
        lines before it in the page being checked."""
        cid = req.custom_id
        size = len(cid.encode())
        if size == 0 or size > MAX_CUSTOM_ID_BYTES:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'custom_id' must be 1 to {MAX_CUSTOM_ID_BYTES} bytes of UTF-8 "
                f"(it is {size}).",
                line=line_no,
                param="custom_id",
            )
        if not self._ids.add(cid, pending):
            raise _duplicate(cid, line_no)
        if req.section is not None and not _section_ok(req.section):
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'section' must be 1 to {MAX_SECTION_ID_BYTES} bytes of UTF-8.",
                line=line_no,
                param="section",
            )
        if req.method != "POST":
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'method' must be 'POST' (it is {req.method!r}).",
                line=line_no,
                param="method",
            )
        if req.url not in ENDPOINTS:
            raise LineError(
                "invalid_url",
                f"Line {line_no}: 'url' must be one of {sorted(ENDPOINTS)} (it is {req.url!r}).",
                line=line_no,
                param="url",
            )
        if self._endpoint is None:
            self._endpoint = req.url
            self._chat = req.url == CHAT_URL
            self._fast = req.url in (CHAT_URL, COMPLETIONS_URL)
        elif req.url != self._endpoint:
            raise LineError(
                "invalid_url",
                f"Line {line_no}: 'url' is {req.url!r} but earlier lines use "
                f"{self._endpoint!r}; one file targets one endpoint.",
                line=line_no,
                param="url",
            )
        model = self._check_model(req.body.model, line_no)
        self._check_body(req.body, req.url, model, line_no)
        return model

    def _check_model(self, name: str, line_no: int) -> CatalogModel:
        if self._model is not None and name == self._model_name:
            return self._model
        model = self._find_model(name)
        if self._model is not None:
            if model is not None and model.id == self._model.id:
                # Another name of the same model (its id, or an alias): one model still.
                return self._model
            first = repr(self._model_name)
            if self._model_name != self._model.id:
                first += f" (model {self._model.id!r})"
            raise LineError(
                "mixed_models",
                f"Line {line_no}: 'body.model' is {name!r} but earlier lines use {first}; a "
                "batch runs one model, so split the file by model.",
                line=line_no,
                param="body.model",
            )
        if model is None or not model.batch:
            why = "is not in the catalog" if model is None else "is not available for batch"
            raise LineError(
                "model_not_found",
                f"Line {line_no}: 'body.model' {name!r} {why}; GET /v1/models lists the batch "
                "models.",
                line=line_no,
                param="body.model",
            )
        self._model, self._model_name = model, name
        return model

    def _check_body(self, body: Body, url: str, model: CatalogModel, line_no: int) -> None:
        if url not in model.endpoints:
            raise LineError(
                "invalid_url",
                f"Line {line_no}: 'url' is {url}, which {model.id} does not serve in batch "
                f"(it serves {', '.join(sorted(model.endpoints))}); GET /v1/models lists each "
                "model's endpoints.",
                line=line_no,
                param="url",
            )
        if body.stream and not self._limits.ignore_stream:
            raise LineError(
                "streaming_unsupported",
                f"Line {line_no}: 'body.stream' must be false or absent; batch results arrive "
                "whole in the output file.",
                line=line_no,
                param="body.stream",
            )
        if body.stream_options not in (_UNSET, None) and not body.stream:
            raise LineError(
                "unsupported_parameter",
                f"Line {line_no}: 'body.stream_options' is only allowed with 'stream': true, "
                "and a batch line does not stream; remove the field.",
                line=line_no,
                param="body.stream_options",
            )
        if body.priority is not _UNSET:
            raise LineError(
                "unsupported_parameter",
                f"Line {line_no}: 'body.priority' is not accepted in a batch; Backfill sets the "
                "engines' request priority itself, so that batch work yields to interactive "
                "traffic. Remove the field.",
                line=line_no,
                param="body.priority",
            )
        _check_reach(body, line_no)
        self._check_output_format(body, url, line_no)
        if url == EMBEDDINGS_URL:
            self._check_embeddings(body, line_no)
            return
        if url == RESPONSES_URL:
            self._check_responses(body, model, line_no)
            return
        limit_field = (
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        )
        limit = _output_limit(body, url)
        if limit is None:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.max_tokens' or 'body.max_completion_tokens' is required "
                "so the batch's cost can be bounded.",
                line=line_no,
                param="body.max_tokens",
            )
        _check_limit(limit, f"body.{limit_field}", model, line_no)
        if url == CHAT_URL:
            self._check_messages(body.messages, model, line_no)
        elif body.prompt is None:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.prompt' is required for /v1/completions.",
                line=line_no,
                param="body.prompt",
            )

    def _check_output_format(self, body: Body, url: str, line_no: int) -> None:
        """A JSON Schema the line asks its answer to match must be a valid one (against its
        draft's meta-schema): the engine would refuse the request otherwise, and
        ``output_validation`` could not check the answer. Nothing else of the format is
        checked: it reaches the engine as written."""
        raw = body.text if url == RESPONSES_URL else body.response_format
        if not raw or raw == self._format_ok:
            return
        fmt = msgspec.json.decode(raw)  # JSON already: the line was decoded
        if url == RESPONSES_URL:
            fmt = fmt.get("format") if isinstance(fmt, dict) else None
        found = schema_of(url, fmt)
        if found is not None:
            where, schema = found
            problem = schema_problem(schema)
            if problem is not None:
                param = f"{format_param(url)}.{where}"
                raise LineError(
                    "invalid_value",
                    f"Line {line_no}: '{param}' is not a valid JSON Schema ({problem}); fix "
                    "the schema, which engines refuse too.",
                    line=line_no,
                    param=param,
                )
        # A file has one endpoint: this is its lines' response_format, or their text.
        self._format_ok = raw

    def _check_embeddings(self, body: Body, line_no: int) -> None:
        _refuse_fields(
            body,
            line_no,
            EMBEDDINGS_URL,
            ("messages", "prompt", "max_tokens", "max_completion_tokens", "max_output_tokens"),
            "an embeddings line has 'input' and no output limit",
        )
        value = body.input
        if not _embedding_input(value):
            raise LineError(
                "missing_required_parameter" if value is _UNSET else "invalid_value",
                f"Line {line_no}: 'body.input' must be a non-empty string, or an array of 1 to "
                f"{MAX_EMBEDDING_INPUTS} strings or token arrays, for /v1/embeddings.",
                line=line_no,
                param="body.input",
            )
        if body.encoding_format is not _UNSET and body.encoding_format not in ENCODING_FORMATS:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.encoding_format' must be 'float' or 'base64' (it is "
                f"{body.encoding_format!r}).",
                line=line_no,
                param="body.encoding_format",
            )
        dims = body.dimensions
        if dims is not _UNSET and (type(dims) is not int or dims < 1):
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.dimensions' must be a positive integer (it is {dims!r}).",
                line=line_no,
                param="body.dimensions",
            )

    def _check_responses(self, body: Body, model: CatalogModel, line_no: int) -> None:
        _refuse_fields(
            body,
            line_no,
            RESPONSES_URL,
            ("messages", "prompt", "max_tokens", "max_completion_tokens", "encoding_format"),
            "a Responses line has 'input' and 'max_output_tokens'",
        )
        if body.background is not _UNSET and body.background is not False:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.background' must be false or absent; a batch request "
                "already runs in the background.",
                line=line_no,
                param="body.background",
            )
        if body.max_output_tokens is None:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.max_output_tokens' is required so the batch's cost can "
                "be bounded.",
                line=line_no,
                param="body.max_output_tokens",
            )
        _check_limit(body.max_output_tokens, "body.max_output_tokens", model, line_no)
        value = body.input
        if isinstance(value, str) and value:
            return
        if not isinstance(value, list) or not value:
            raise LineError(
                "missing_required_parameter" if value is _UNSET else "invalid_value",
                f"Line {line_no}: 'body.input' must be a non-empty string or array of input "
                "items for /v1/responses.",
                line=line_no,
                param="body.input",
            )
        media = LineMedia(self._limits.media)
        for i, item in enumerate(value):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise LineError(
                    "invalid_value",
                    f"Line {line_no}: 'body.input[{i}]' must be a message object "
                    '({"role": …, "content": …}); other input items are not accepted in batch.',
                    line=line_no,
                    param=f"body.input[{i}]",
                )
            content = item.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                where = f"body.input[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _RESPONSE_PARTS:
                    raise LineError(
                        "invalid_value",
                        f"Line {line_no}: '{where}.type' must be one of "
                        f"{', '.join(sorted(_RESPONSE_PARTS))} (it is {kind!r}).",
                        line=line_no,
                        param=f"{where}.type",
                    )
                if kind == "input_image":
                    assert isinstance(part, dict)
                    self._media(model, "image", where, line_no)
                    with _as_line_error(line_no):
                        url = part.get("image_url")
                        media.add(check_image_url(url, f"{where}.image_url", media.limits), where)

    def _check_messages(
        self, messages: list[Message] | None, model: CatalogModel, line_no: int
    ) -> None:
        if not messages:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.messages' must be a non-empty array for "
                "/v1/chat/completions.",
                line=line_no,
                param="body.messages",
            )
        media: LineMedia | None = None
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise LineError(
                    "invalid_value",
                    f"Line {line_no}: 'body.messages[{i}].role' must be one of {sorted(ROLES)} "
                    f"(it is {message.role!r}).",
                    line=line_no,
                    param=f"body.messages[{i}].role",
                )
            if isinstance(message.content, list):
                media = media or LineMedia(self._limits.media)
                for j, part in enumerate(message.content):
                    where = f"body.messages[{i}].content[{j}]"
                    self._check_part(part, model, media, line_no, where)

    def _check_part(
        self, part: ContentPart, model: CatalogModel, media: LineMedia, line_no: int, where: str
    ) -> None:
        if part.type == "text":
            return
        needs = _CHAT_PARTS.get(part.type)
        if needs is None:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: '{where}.type' {part.type!r} is not a known content part type "
                "(text, image_url, input_audio).",
                line=line_no,
                param=f"{where}.type",
            )
        self._media(model, needs, where, line_no)
        with _as_line_error(line_no):
            if needs == "image":
                image = part.image_url
                url = image.get("url") if isinstance(image, dict) else None
                size = check_image_url(url, f"{where}.image_url.url", media.limits)
            else:
                size = check_audio(part.input_audio, f"{where}.input_audio", media.limits)
            media.add(size, where)

    @staticmethod
    def _media(model: CatalogModel, needs: str, where: str, line_no: int) -> None:
        if needs not in model.modalities:
            raise LineError(
                "unsupported_modality",
                f"Line {line_no}: '{where}' is {needs} input, which {model.id} does not accept "
                f"in batch (it accepts {', '.join(sorted(model.modalities))}).",
                line=line_no,
                param=where,
            )

    def summary(self) -> FileSummary:
        """What the file's lines agreed on; ``model`` is the catalog id the lines' names
        resolved to (an alias is resolved here, at upload, once)."""
        return FileSummary(
            lines=self.lines,
            model=self._model.id if self._model is not None else None,
            endpoint=self._endpoint,
            prompt_token_bound=self._prompt_bound,
            max_output_tokens=self._max_output,
        )


def _duplicate(cid: str, line_no: int) -> LineError:
    return LineError(
        "duplicate_custom_id",
        f"Line {line_no}: custom_id {cid!r} is used by an earlier line; each line needs its own.",
        line=line_no,
        param="custom_id",
    )


def _section_ok(section: str) -> bool:
    return bool(section) and (len(section) <= 32 or len(section.encode()) <= MAX_SECTION_ID_BYTES)


@contextmanager
def _as_line_error(line_no: int) -> Iterator[None]:
    """A media part's broken rule, as the line's error."""
    try:
        yield
    except MediaError as exc:
        raise LineError(
            exc.code, f"Line {line_no}: {exc.message}", line=line_no, param=exc.param
        ) from None


def _output_limit(body: Body, url: str | None) -> int | None:
    """The line's output-token limit, by its endpoint (embeddings produce none)."""
    if url == RESPONSES_URL:
        return body.max_output_tokens
    if url == EMBEDDINGS_URL:
        return 0
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _check_limit(limit: int, param: str, model: CatalogModel, line_no: int) -> None:
    if limit < 1 or limit > model.max_output_tokens:
        raise LineError(
            "invalid_value",
            f"Line {line_no}: '{param}' must be between 1 and {model.max_output_tokens} for "
            f"{model.id} (it is {limit}).",
            line=line_no,
            param=param,
        )


def _refuse_fields(
    body: Body, line_no: int, url: str, names: tuple[str, ...], instead: str
) -> None:
    """Fields of other endpoints: the engine would ignore or refuse them, so the upload does."""
    for name in names:
        if getattr(body, name) not in (None, _UNSET):
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.{name}' is not a field of {url} requests; {instead}.",
                line=line_no,
                param=f"body.{name}",
            )


def _plain_tools(tools: Any) -> bool:
    """Whether ``tools`` is a list of tools of ``TOOL_TYPES`` only."""
    return isinstance(tools, list) and all(
        isinstance(tool, dict) and tool.get("type") in TOOL_TYPES for tool in tools
    )


def _check_reach(body: Body, line_no: int) -> None:
    """Refuse what would make the engine reach past the request: tools other than functions,
    engine-side state, web search (see ``TOOL_TYPES``)."""
    for name, keeps in (
        ("previous_response_id", "a stored response"),
        ("conversation", "a stored conversation"),
    ):
        if getattr(body, name) not in (None, _UNSET):
            raise LineError(
                "unsupported_parameter",
                f"Line {line_no}: 'body.{name}' is not accepted in a batch: it names "
                f"{keeps} the engine keeps, which Backfill cannot check belongs to your "
                "organization. Remove it and put the earlier turns in the request itself.",
                line=line_no,
                param=f"body.{name}",
            )
    if body.web_search_options not in (None, _UNSET):
        raise LineError(
            "unsupported_parameter",
            f"Line {line_no}: 'body.web_search_options' is not accepted in a batch: the engine "
            "would fetch web pages that Backfill does not check. Remove the field.",
            line=line_no,
            param="body.web_search_options",
        )
    store = body.store
    if store is not _UNSET and store is not None and store is not False:
        raise LineError(
            "invalid_value",
            f"Line {line_no}: 'body.store' must be false or absent in a batch; results are "
            "kept in the batch's output file, never stored by the engine.",
            line=line_no,
            param="body.store",
        )
    tools = body.tools
    if tools is _UNSET or tools is None:
        return
    if not isinstance(tools, list):
        raise LineError(
            "invalid_value",
            f"Line {line_no}: 'body.tools' must be an array of function tools.",
            line=line_no,
            param="body.tools",
        )
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.tools[{i}]' must be a function tool object "
                '({"type": "function", …}).',
                line=line_no,
                param=f"body.tools[{i}]",
            )
        kind = tool.get("type")
        if kind not in TOOL_TYPES:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.tools[{i}].type' is {kind!r}, but a batch accepts "
                "only 'function' tools (a name and a JSON schema). Other tools (MCP servers, "
                "file search, web search, code interpreters) would have the engine reach "
                "servers, files or stored data that Backfill does not check; remove the tool.",
                line=line_no,
                param=f"body.tools[{i}].type",
            )


def _embedding_input(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_EMBEDDING_INPUTS:
        return False
    first = value[0]
    if isinstance(first, str):
        return all(isinstance(v, str) and v for v in value)
    if isinstance(first, list):
        return all(isinstance(v, list) and v and _token_ids(v) for v in value)
    return _token_ids(value)


def _token_ids(values: list[Any]) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def request_body(raw: bytes) -> dict[str, Any]:
    """The body of a validated line, ready to send to an engine.

    Each top-level field stays the raw JSON the user sent (``msgspec.Raw``) and is forwarded
    verbatim: whatever the upload accepted can be sent — integers beyond 64 bits, ``1e400``,
    deep nesting — and the engine, not a re-encoding, decides what it makes of it.
    """
    return _BODY.decode(raw).body
