"""A stricter decoder for the common chat line, built once a file's first line has fixed its
model and output limit.

The rules the validator's fast path would check in Python for every line (the method, the URL,
the model, each message's role and text content, the output limit's range, no streaming, no
``priority``, function tools only, nothing stored engine-side, no ``response_format``) become
types that msgspec checks in C while it decodes. Its structs are not tracked by the cyclic
garbage collector either: decoded data holds no cycles, and a million lines would otherwise
trigger a collection every few hundred lines.

A line this decoder refuses is not necessarily wrong: the validator then decodes it with the
full structs and its detailed checks, which accept it or name the rule it breaks. So the strict
structs may only ever refuse more than those, never less: every other field keeps the type the
full struct gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol, cast

import msgspec
from msgspec import Meta

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
_CHAT_URL = "/v1/chat/completions"


class StrictMessage(msgspec.Struct, gc=False):
    role: Role
    content: str


class StrictTool(msgspec.Struct, gc=False):
    """A function tool; its other fields keep any value, as the full checks let them."""

    type: Literal["function"]


class StrictBody(Protocol):
    @property
    def messages(self) -> list[StrictMessage]: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def max_completion_tokens(self) -> int | None: ...


class StrictChatLine(Protocol):
    @property
    def custom_id(self) -> str: ...
    @property
    def section(self) -> str | None: ...
    @property
    def body(self) -> StrictBody: ...


def _stricter(
    base: type[msgspec.Struct],
    name: str,
    types: dict[str, Any],
    required: frozenset[str] = frozenset(),
) -> type[msgspec.Struct]:
    """``base``'s fields in order with their defaults, those named in ``types`` narrowed and
    those in ``required`` without a default (a default is not checked against the narrowed
    type: an absent field would pass as it); unknown fields are refused where ``base``
    refuses them."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(base):
        kind = types.get(f.name, f.type)
        if f.required or f.name in required:
            fields.append((f.name, kind))
        else:
            fields.append((f.name, kind, f.default))
    forbid = base.__struct_config__.forbid_unknown_fields
    return msgspec.defstruct(name, fields, gc=False, forbid_unknown_fields=forbid)


def strict_chat_decoder(
    line: type[msgspec.Struct], body: type[msgspec.Struct], model: str, max_tokens: int
) -> Callable[[bytes], StrictChatLine]:
    """Decodes a chat line of ``line``'s shape (its ``body`` of ``body``'s) for ``model``
    whose output limit is within ``max_tokens``; anything else raises msgspec's errors."""
    limit = Annotated[int, Meta(gt=0, le=max_tokens)] | None
    strict_body = _stricter(
        body,
        "StrictChatBody",
        {
            "model": Literal[model],
            "messages": Annotated[list[StrictMessage], Meta(min_length=1)],
            "max_tokens": limit,
            "max_completion_tokens": limit,
            "stream": Literal[False] | None,
            "stream_options": msgspec.UnsetType,
            # Present at all, it is refused with its reason by the full checks.
            "priority": msgspec.UnsetType,
            "tools": list[StrictTool] | None,
            "store": Literal[False] | None,
            # Accepted when null by the full checks; rare enough to leave to them.
            "previous_response_id": msgspec.UnsetType,
            "conversation": msgspec.UnsetType,
            "web_search_options": msgspec.UnsetType,
            # Its JSON Schema is checked by the full checks (once per distinct format).
            "response_format": msgspec.UnsetType,
        },
        required=frozenset({"messages"}),
    )
    strict_line = _stricter(
        line,
        "StrictChatLine",
        {
            "custom_id": Annotated[str, Meta(min_length=1)],
            "method": Literal["POST"],
            "url": Literal[_CHAT_URL],
            "body": strict_body,
        },
    )
    return cast(Callable[[bytes], StrictChatLine], msgspec.json.Decoder(strict_line).decode)


def _short_enough(text: str, max_bytes: int) -> bool:
    """Non-empty and within ``max_bytes`` of UTF-8, where its length tells; a longer text
    that is not ASCII is left to the detailed checks (they encode it)."""
    size = len(text)
    return size > 0 and (4 * size <= max_bytes or (size <= max_bytes and text.isascii()))


def chat_run_py(
    lines: list[bytes],
    start: int,
    decode: Callable[[bytes], StrictChatLine],
    errors: tuple[type[Exception], ...],
    context: int,
    max_id_bytes: int,
    ids: list[str],
) -> tuple[int, int, int, bool]:
    """Accept ``lines[start:]`` while each is the common chat line: ``decode`` (a
    ``strict_chat_decoder``) takes it, it has an output limit, and its ``custom_id`` and
    ``section`` are 1 to ``max_id_bytes`` bytes of UTF-8 (``_short_enough``). Each accepted
    line's ``custom_id`` is appended to ``ids``. Returns the first line not accepted
    (``len(lines)`` when all were), the accepted lines' prompt-token bounds and output limits
    summed, and whether ``decode`` refused that line with one of ``errors``.
    ``_speedups.chat_run`` does the same in C."""
    prompt_bound = max_output = 0
    append = ids.append
    for i in range(max(start, 0), len(lines)):
        raw = lines[i]
        try:
            line = decode(raw)
        except errors:
            return i, prompt_bound, max_output, True
        cid = line.custom_id
        body = line.body
        # Either limit is absent or above 0 here: ``or`` picks as the rule does.
        limit = body.max_completion_tokens or body.max_tokens
        section = line.section
        if (
            limit is None
            or not _short_enough(cid, max_id_bytes)
            or (section is not None and not _short_enough(section, max_id_bytes))
        ):
            return i, prompt_bound, max_output, False
        # An upper bound on prompt tokens without a tokenizer: a token of text covers at least
        # one byte of the line, and a chat template adds a few tokens per message.
        bound = len(raw) + 8 * (len(body.messages) + 1)
        prompt_bound += bound if bound < context else context
        max_output += limit
        append(cid)
    return len(lines), prompt_bound, max_output, False


try:
    from backfill.domain._speedups import chat_run as chat_run
except ImportError:  # not compiled where Backfill was installed: the same loop in Python
    chat_run = chat_run_py
