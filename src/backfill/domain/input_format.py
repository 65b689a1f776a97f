"""The rules of one batch input line (SPEC §5), applied line by line as an upload streams in.

Lines are decoded into typed ``msgspec`` structs: that one pass both parses and type-checks, so
the per-line Python work left is a handful of comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from backfill.domain.catalog import CatalogModel
from backfill.domain.decode_errors import Broken, explain

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = frozenset({CHAT_URL, COMPLETIONS_URL})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_CUSTOM_ID_BYTES = 128
_UNSET = msgspec.UNSET


class ContentPart(msgspec.Struct):
    type: str


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class Body(msgspec.Struct):
    model: str
    messages: list[Message] | None = None
    prompt: str | list[Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool | None = None
    priority: Any = msgspec.UNSET
    """Refused: the operator's engine settings set it (docs/scheduling.md)."""


class RequestLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: Body


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


def _decode_error(line_no: int, error: msgspec.ValidationError) -> LineError:
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
            f"Line {line_no}: unknown field '{param}'; a line has only custom_id, method, url "
            "and body.",
            line=line_no,
            param=param,
        )
    if problem.broken is Broken.NOT_OBJECT:
        return LineError(
            "invalid_json_line",
            f"Line {line_no} is not a JSON object; each line must be one object with "
            "custom_id, method, url and body.",
            line=line_no,
        )
    where = f" in field '{param}'" if param else ""
    return LineError(
        "invalid_value", f"Line {line_no}: {problem.reason}{where}.", line=line_no, param=param
    )


class LineValidator:
    """Checks the lines of one file in order; keeps what cross-line rules need."""

    def __init__(self, limits: Limits, find_model: Callable[[str], CatalogModel | None]) -> None:
        self._limits = limits
        self._find_model = find_model
        self._seen: set[str] = set()
        self._model: CatalogModel | None = None
        self._model_name: str | None = None
        self._endpoint: str | None = None
        self._chat = False
        self.lines = 0
        self._prompt_bound = 0
        self._max_output = 0

    def check_lines(self, lines: list[bytes], first_line_no: int) -> list[str]:
        """Validate consecutive lines; returns their ``custom_id``s.

        The common case (a valid line like the ones before it) takes one decode and a few
        comparisons inside this one loop; anything unusual goes through the detailed checks,
        which name the rule that was broken.
        """
        last = first_line_no + len(lines) - 1
        if last > self._limits.max_lines:
            # The lines within the limit first: an earlier bad line is the one reported, however
            # the file was cut into chunks.
            self.check_lines(
                lines[: max(self._limits.max_lines - first_line_no + 1, 0)], first_line_no
            )
            line_no = self._limits.max_lines + 1
            raise LineError(
                "too_many_requests_in_file",
                f"Line {line_no}: a file holds at most {self._limits.max_lines} requests; "
                "split it into several batches.",
                line=line_no,
            )
        decode = _DECODER.decode
        seen = self._seen
        add = seen.add
        roles = ROLES
        ids: list[str] = []
        append = ids.append
        prompt_bound = 0
        max_output = 0
        line_no = first_line_no - 1
        # What the lines so far agreed on, as locals: the slow path refreshes them.
        model, model_name, endpoint, chat = (
            self._model,
            self._model_name,
            self._endpoint,
            self._chat,
        )
        max_tokens = model.max_output_tokens if model else 0
        for raw in lines:
            line_no += 1
            try:
                req = decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
                raise self._undecodable(raw, line_no, exc) from None
            body = req.body
            cid = req.custom_id
            before = len(seen)
            add(cid)
            messages = body.messages
            limit = body.max_completion_tokens
            if limit is None:
                limit = body.max_tokens
            if (
                model is None
                or len(seen) == before
                or not cid
                or (len(cid) > 32 and len(cid.encode()) > MAX_CUSTOM_ID_BYTES)
                or req.method != "POST"
                or req.url != endpoint
                or body.model != model_name
                or body.stream
                or body.priority is not _UNSET
                or limit is None
                or not 0 < limit <= max_tokens
                or (messages is None if chat else body.prompt is None)
            ):
                if len(seen) != before:
                    seen.discard(cid)
                model = self._check_request(req, line_no)
                model_name, endpoint, chat = self._model_name, self._endpoint, self._chat
                max_tokens = model.max_output_tokens
            elif chat:
                # A completions line may carry messages too: they are not read, so not checked.
                if messages:
                    for message in messages:
                        if message.role not in roles or message.content.__class__ is list:
                            self._check_messages(messages, model, line_no)
                            break
                else:
                    self._check_messages(messages, model, line_no)
            # An upper bound on prompt tokens without a tokenizer: a token of text covers at
            # least one byte of the line, and a chat template adds a few tokens per message.
            bound = len(raw) + 8 * (len(messages) + 1 if messages else 2)
            context = model.context_length
            prompt_bound += bound if bound < context else context
            max_output += limit or 0
            append(cid)
        self.lines = last
        self._prompt_bound += prompt_bound
        self._max_output += max_output
        return ids

    @staticmethod
    def _undecodable(raw: bytes, line_no: int, exc: Exception) -> LineError:
        if not raw.strip():
            return LineError(
                "invalid_json_line",
                f"Line {line_no} is empty; remove blank lines (only a final newline is allowed).",
                line=line_no,
            )
        if isinstance(exc, msgspec.ValidationError):
            return _decode_error(line_no, exc)
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

    def _check_request(self, req: RequestLine, line_no: int) -> CatalogModel:
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
        if cid in self._seen:
            raise LineError(
                "duplicate_custom_id",
                f"Line {line_no}: custom_id {cid!r} is used by an earlier line; each line needs "
                "its own.",
                line=line_no,
                param="custom_id",
            )
        self._seen.add(cid)
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
        if self._model_name is not None:
            raise LineError(
                "mixed_models",
                f"Line {line_no}: 'body.model' is {name!r} but earlier lines use "
                f"{self._model_name!r}; a batch runs one model, so split the file by model.",
                line=line_no,
                param="body.model",
            )
        model = self._find_model(name)
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
        if body.stream:
            raise LineError(
                "streaming_unsupported",
                f"Line {line_no}: 'body.stream' must be false or absent; batch results arrive "
                "whole in the output file.",
                line=line_no,
                param="body.stream",
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
        limit_field = (
            "max_completion_tokens" if body.max_completion_tokens is not None else ("max_tokens")
        )
        limit = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else (body.max_tokens)
        )
        if limit is None:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.max_tokens' or 'body.max_completion_tokens' is required "
                "so the batch's cost can be bounded.",
                line=line_no,
                param="body.max_tokens",
            )
        if limit < 1 or limit > model.max_output_tokens:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: 'body.{limit_field}' must be between 1 and "
                f"{model.max_output_tokens} for {model.id} (it is {limit}).",
                line=line_no,
                param=f"body.{limit_field}",
            )
        if url == CHAT_URL:
            self._check_messages(body.messages, model, line_no)
        elif body.prompt is None:
            raise LineError(
                "missing_required_parameter",
                f"Line {line_no}: 'body.prompt' is required for /v1/completions.",
                line=line_no,
                param="body.prompt",
            )

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
                for j, part in enumerate(message.content):
                    self._check_part(part, model, line_no, f"body.messages[{i}].content[{j}]")

    def _check_part(self, part: ContentPart, model: CatalogModel, line_no: int, where: str) -> None:
        needs = {"image_url": "image", "input_audio": "audio"}.get(part.type)
        if part.type == "text":
            return
        if needs is None:
            raise LineError(
                "invalid_value",
                f"Line {line_no}: '{where}.type' {part.type!r} is not a known content part type.",
                line=line_no,
                param=f"{where}.type",
            )
        if needs not in model.modalities:
            raise LineError(
                "unsupported_modality",
                f"Line {line_no}: '{where}' is {needs} input, which {model.id} does not accept "
                f"(it accepts {', '.join(sorted(model.modalities))}).",
                line=line_no,
                param=where,
            )

    def summary(self) -> FileSummary:
        return FileSummary(
            lines=self.lines,
            model=self._model_name,
            endpoint=self._endpoint,
            prompt_token_bound=self._prompt_bound,
            max_output_tokens=self._max_output,
        )


def request_body(raw: bytes) -> dict[str, Any]:
    """The body of a validated line, ready to send to an engine.

    Each top-level field stays the raw JSON the user sent (``msgspec.Raw``) and is forwarded
    verbatim: whatever the upload accepted can be sent — integers beyond 64 bits, ``1e400``,
    deep nesting — and the engine, not a re-encoding, decides what it makes of it.
    """
    return _BODY.decode(raw).body
