"""Structured outputs of the simulated engine: answers in the shape a request's
``response_format`` (chat, completions) or ``text.format`` (Responses) asks for, as an engine
that constrains its decoding to a grammar gives them.

``json_object`` is answered with ``{"answer": "tok tok …"}``; ``json_schema`` with a small
instance of the schema (``instance``: the common keywords, not every one). Two directives
in the prompt make it answer off the format, for tests of whatever checks answers:
``[[sim:off_schema]]`` answers JSON of the wrong type at the top (an array of ``tok``, or an
object when the format asks for an array) and ``[[sim:not_json]]`` answers the plain words. An
answer cut short by the output limit is cut short here too: the first half of its JSON text.
Streamed answers stay plain words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from backfill.simulator import fields, replies
from backfill.simulator.fields import BadRequest

TYPES = ("text", "json_object", "json_schema")
# How deep ``instance`` follows a schema: a recursive one ($ref to itself) stops here.
_MAX_DEPTH = 16


@dataclass(frozen=True)
class Format:
    """What a request asks its answer to be."""

    kind: str
    """``json_object`` or ``json_schema``."""
    schema: Any = True
    """The JSON Schema (``json_schema``); True: any JSON."""


def of_chat(body: dict[str, Any]) -> Format | None:
    """The ``response_format`` of a chat or completions body, refused (400) where an engine
    refuses it; None for plain text."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("response_format", "response_format must be an object")
    kind = _kind(value, "response_format")
    if kind != "json_schema":
        return Format(kind) if kind == "json_object" else None
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("response_format.json_schema", "json_schema must be an object")
    fields.optional_string(spec, "name")
    return Format(kind, _schema(spec, "response_format.json_schema.schema"))


def of_responses(body: dict[str, Any]) -> tuple[Format | None, dict[str, Any]]:
    """The ``text.format`` of a Responses body, and the ``text`` its answer repeats."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise BadRequest("text", "text must be an object")
    fields.only_known(text, ("format", "verbosity"))
    value = text.get("format")
    if value is None:
        return None, {**text, "format": {"type": "text"}}
    if not isinstance(value, dict):
        raise BadRequest("text.format", "text.format must be an object")
    kind = _kind(value, "text.format")
    if kind == "json_schema":
        return Format(kind, _schema(value, "text.format.schema")), text
    return (Format(kind) if kind == "json_object" else None), text


def _kind(value: dict[str, Any], param: str) -> str:
    kind = value.get("type")
    if kind not in TYPES:
        raise BadRequest(f"{param}.type", f"{param}.type must be one of {', '.join(TYPES)}")
    assert isinstance(kind, str)
    return kind


def _schema(spec: dict[str, Any], param: str) -> Any:
    schema = spec.get("schema", True)
    if not isinstance(schema, dict | bool):
        raise BadRequest(param, "a JSON schema must be an object or a boolean")
    return schema


def answer(fmt: Format, tokens: int, directives: dict[str, str | None], cut_short: bool) -> str:
    """The answer's text for ``tokens`` output tokens."""
    if "not_json" in directives:
        return replies.answer_text(tokens)
    if fmt.kind == "json_object":
        value: Any = {"answer": replies.answer_text(tokens)}
    else:
        value = instance(fmt.schema, fmt.schema)
    if "off_schema" in directives:
        wants_array = isinstance(fmt.schema, dict) and _first_type(fmt.schema) == "array"
        words = [replies.TOKEN] * max(tokens, 1)
        value = {replies.TOKEN: replies.answer_text(tokens)} if wants_array else words
    text = orjson.dumps(value).decode()
    # As an engine stopped at its output limit: the JSON is not closed.
    return text[: max(1, len(text) // 2)] if cut_short else text


def instance(schema: Any, root: Any, depth: int = 0) -> Any:
    """A small value valid against ``schema`` for the keywords most schemas use: ``const``,
    ``enum``, ``type``, an object's ``required`` properties, an array's ``minItems`` of
    ``items``, string lengths, numeric bounds, ``anyOf`` / ``oneOf`` / ``allOf`` (the first
    branch) and ``$ref`` within ``root``. ``pattern``, ``format`` and the like are not
    followed."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return instance(_local(ref, root), root, depth + 1)
    for key in ("allOf", "anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            merged = {k: v for k, v in schema.items() if k != key}
            first = branches[0] if isinstance(branches[0], dict) else {}
            return instance({**merged, **first}, root, depth + 1)
    kind = _first_type(schema)
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
        return {n: instance(props.get(n, {}), root, depth + 1) for n in names}
    if kind == "array":
        count = _int(schema.get("minItems")) or 0
        return [instance(schema.get("items", {}), root, depth + 1) for _ in range(count)]
    if kind == "string":
        return _string(schema)
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    return None


def _first_type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [k for k in kind if isinstance(k, str) and k != "null"]
        kind = named[0] if named else (kind[0] if kind else None)
    if kind is None and "properties" in schema:
        return "object"
    if kind is None and "items" in schema:
        return "array"
    return kind if isinstance(kind, str) else None


def _local(ref: str, root: Any) -> Any:
    """What a ``#/…`` reference points at in ``root``; {} (anything) otherwise."""
    if not ref.startswith("#"):
        return {}
    node = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return {}
    return node


def _int(value: Any) -> int | None:
    return value if fields.is_int(value) and value >= 0 else None


def _number_of(value: Any) -> float | None:
    return float(value) if fields.is_number(value) else None


def _string(schema: dict[str, Any]) -> str:
    least = _int(schema.get("minLength"))
    most = _int(schema.get("maxLength"))
    text = replies.TOKEN
    if least is not None and len(text) < least:
        text = (text * (least // len(text) + 1))[:least]
    if most is not None and len(text) > most:
        text = text[:most]
    return text


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    low, high = _number_of(schema.get("minimum")), _number_of(schema.get("maximum"))
    above = _number_of(schema.get("exclusiveMinimum"))
    below = _number_of(schema.get("exclusiveMaximum"))
    value = 0.0
    if low is not None:
        value = low
    elif above is not None:
        value = above + (1 if integer else 0.5)
    elif high is not None and high < 0:
        value = high
    elif below is not None and below <= 0:
        value = below - 1
    if integer:
        return int(value) if value.is_integer() else int(value) + 1
    return value
