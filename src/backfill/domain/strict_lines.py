"""A stricter decoder for the common chat line, built once a file's first line has fixed its
model and output limit.

The rules the validator's fast path would check in Python for every line (the method, the URL,
the model, each message's role and text content, the output limit's range, no streaming, no
``priority``) become types that msgspec checks in C while it decodes. Its structs are not
tracked by the cyclic garbage collector either: decoded data holds no cycles, and a million
lines would otherwise trigger a collection every few hundred lines.

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
            # Present at all, it is refused with its reason by the full checks.
            "priority": msgspec.UnsetType,
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
