"""Structured outputs: what a line asks its answer to be, and whether an answer is that.

A chat or completions line asks with ``response_format``, a Responses line with
``text.format``: ``{"type": "json_object"}`` (a JSON object) or ``{"type": "json_schema", …}``
(JSON valid against a JSON Schema: ``json_schema.schema`` in chat and completions, ``schema``
in Responses). Backfill sends the field to the engine unchanged (vLLM, SGLang and llama.cpp
constrain their decoding to it). This module checks, at upload, that such a schema is itself a
valid JSON Schema, and, for a batch created with ``output_validation``, each answer against
it when it arrives: an answer that is not what was asked becomes an error row
``output_schema_mismatch``. Other types (``text``, an engine's own such as ``regex``) ask for
nothing Backfill checks.

Schemas are applied by ``jsonschema`` with the draft their ``$schema`` names (2020-12 when
none), resolving ``$ref`` only inside the schema (and the drafts' own meta-schemas): a
reference to any other URI is never fetched. ``format`` is an annotation, as the drafts
define it, not an assertion.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from backfill.domain.endpoints import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

# jsonschema is imported where a schema is first checked, not with this module: importing it
# takes about 70 ms, which every CLI command and process would pay, most of them never
# checking a schema.

OUTPUT_SCHEMA_MISMATCH = "output_schema_mismatch"
JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
# Where a line asks, by endpoint; the others (embeddings) produce no text to check.
FORMAT_FIELDS = {
    CHAT_URL: "response_format",
    COMPLETIONS_URL: "response_format",
    RESPONSES_URL: "text.format",
}
# A mismatch message quotes the validator's, which may quote the answer: kept short (the
# answer itself is in the row), its start and its end, which say what was expected.
_MAX_REASON = 300


@dataclass(frozen=True, slots=True)
class Expected:
    """What the answers of one line must be."""

    endpoint: str
    kind: str
    """``json_object`` or ``json_schema``."""
    validator: Validator | None = None
    """The schema's validator (``json_schema``'s; ``json_object``'s in llama-cpp-python's
    shape, with a ``schema``); None: any JSON (``json_object``: any object)."""
    broken: str | None = None
    """Why the line's schema cannot be applied (a line uploaded before schemas were checked
    at upload): then every answer mismatches, saying so."""


def format_param(endpoint: str) -> str:
    """Where a line of ``endpoint`` asks for structured output (``body.…``)."""
    return "body." + FORMAT_FIELDS.get(endpoint, "response_format")


def format_of(endpoint: str, body: Mapping[str, Any]) -> Any:
    """The line's structured output format, decoded (the body's fields may be the line's raw
    JSON, ``msgspec.Raw``); None when it asks for none."""
    if endpoint == RESPONSES_URL:
        text = _decoded(body.get("text"))
        return text.get("format") if isinstance(text, dict) else None
    if endpoint in FORMAT_FIELDS:
        return _decoded(body.get("response_format"))
    return None


def schema_of(endpoint: str, fmt: Any) -> tuple[str, Any] | None:
    """``(where, schema)`` of a ``json_schema`` format that gives one: ``where`` is the path
    below the format field (``json_schema.schema``, or ``schema`` for Responses)."""
    if not isinstance(fmt, dict) or fmt.get("type") != JSON_SCHEMA:
        return None
    if endpoint == RESPONSES_URL:
        return ("schema", fmt["schema"]) if "schema" in fmt else None
    spec = fmt.get("json_schema")
    if isinstance(spec, dict) and "schema" in spec:
        return "json_schema.schema", spec["schema"]
    return None


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (against the meta-schema of its draft), as a
    person can act on it; None when it is."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a JSON Schema is an object or a boolean, not {_json_type(schema)}"
    if not isinstance(schema.get("$schema", ""), str):
        # Looked up among the drafts before anything else: it must be a URI.
        return "at $['$schema']: it must be the URI of a JSON Schema draft"
    from jsonschema import Draft202012Validator, validators
    from jsonschema.exceptions import SchemaError

    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        return f"at {exc.json_path}: {_short(exc.message)}"
    except RecursionError:
        return "it nests too deeply to be checked"
    return None


def expected(endpoint: str, body: Mapping[str, Any]) -> Expected | None:
    """What the answers of a line (its validated body) must be; None when it asks for
    nothing Backfill checks."""
    fmt = format_of(endpoint, body)
    if not isinstance(fmt, dict):
        return None
    kind = fmt.get("type")
    if kind == JSON_OBJECT:
        # llama-cpp-python's own shape of a schema: ``{"type": "json_object", "schema": …}``.
        if "schema" not in fmt:
            return Expected(endpoint, JSON_OBJECT)
        schema = fmt["schema"]
    elif kind == JSON_SCHEMA:
        found = schema_of(endpoint, fmt)
        if found is None:
            return Expected(endpoint, JSON_SCHEMA)
        schema = found[1]
    else:
        return None
    # Lines of a batch mostly share one schema: its validator is built once.
    return _compiled(endpoint, kind, msgspec.json.encode(schema, order="sorted"))


@functools.lru_cache(maxsize=256)
def _compiled(endpoint: str, kind: str, schema_json: bytes) -> Expected:
    schema = msgspec.json.decode(schema_json)
    problem = schema_problem(schema)
    if problem is not None:
        return Expected(endpoint, kind, broken=f"the line's schema is not valid: {problem}")
    from jsonschema import Draft202012Validator, validators
    from referencing import Registry

    cls = validators.validator_for(schema, default=Draft202012Validator)
    try:
        # An empty registry retrieves nothing: a ``$ref`` outside the schema (and the drafts'
        # own meta-schemas) is unresolvable, never fetched.
        validator = cls(schema, registry=Registry())
    except Exception as exc:  # the validator's own refusal of a schema its meta-schema took
        return Expected(endpoint, kind, broken=f"the line's schema cannot be applied: {exc}")
    return Expected(endpoint, kind, validator=validator)


def mismatch(expected: Expected, answer: Any) -> str | None:
    """Why the engine's answer (a 200 body) is not what its line asked for, as the error
    row's message; None when it is. Every choice of a chat or completions answer is checked,
    the first mismatch told."""
    why = _mismatch(expected, answer)
    if why is None:
        return None
    return (
        f"The answer does not match the line's {format_param(expected.endpoint)} "
        f"({expected.kind}): {why}."
    )


def _mismatch(expected: Expected, answer: Any) -> str | None:
    if expected.broken is not None:
        return expected.broken
    if expected.endpoint == RESPONSES_URL:
        return _response_mismatch(expected, answer)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices:
        return "the answer has no choices to check"
    chat = expected.endpoint == CHAT_URL
    for i, choice in enumerate(choices):
        where = f"choices[{i}].message.content" if chat else f"choices[{i}].text"
        if not isinstance(choice, dict):
            return f"choices[{i}] is not an object"
        if choice.get("finish_reason") == "length":
            limit = "max_completion_tokens (or max_tokens)" if chat else "max_tokens"
            return (
                f"{where} was cut off at the output limit (finish_reason 'length'), so its "
                f"JSON is incomplete; raise the line's {limit}"
            )
        message = choice.get("message") if chat else choice
        text = message.get("content" if chat else "text") if isinstance(message, dict) else None
        if text is None and chat and isinstance(message, dict) and message.get("refusal"):
            return f"{where} is null: the model refused ({_short(str(message['refusal']))})"
        why = _text_mismatch(expected, text, where)
        if why is not None:
            return why
    return None


def _response_mismatch(expected: Expected, answer: Any) -> str | None:
    if not isinstance(answer, dict):
        return "the answer is not a Response object"
    if answer.get("status") == "incomplete":
        details = answer.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return (
            f"the response is incomplete ({reason or 'no reason given'}), so its JSON is cut "
            "off; raise the line's max_output_tokens"
        )
    texts: list[str] = []
    for item in answer.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    texts.append(str(part.get("text") or ""))
    if not texts:
        return "the response has no output_text to check"
    # The Response's ``output_text``: its message texts, joined.
    return _text_mismatch(expected, "".join(texts), "output_text")


def _text_mismatch(expected: Expected, text: Any, where: str) -> str | None:
    if not isinstance(text, str):
        return f"{where} is {_json_type(text)}, not JSON text"
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return f"{where} is not JSON ({_short(str(exc))})"
    if expected.kind == JSON_OBJECT and not isinstance(value, dict):
        return f"{where} is {_json_type(value)}, but json_object asks for a JSON object"
    validator = expected.validator
    if validator is None:
        return None
    from jsonschema.exceptions import best_match
    from referencing.exceptions import Unresolvable

    try:
        error = best_match(validator.iter_errors(value))
    except Unresolvable as exc:
        # Only references inside the schema resolve: nothing is fetched for an answer.
        return (
            f"the line's schema refers to {_short(exc.ref)!r}, which is not inside the schema; "
            "Backfill resolves only references within it"
        )
    except RecursionError:
        return f"{where} nests too deeply to be checked"
    except Exception as exc:
        # A schema the meta-schema took but the validator cannot apply to this answer: the
        # request ends with a row saying so, rather than going back to the queue for ever.
        return f"the line's schema cannot be applied to {where}: {_short(str(exc))}"
    if error is None:
        return None
    return f"{where} does not match the schema at {error.json_path}: {_short(error.message)}"


def _decoded(value: Any) -> Any:
    if isinstance(value, msgspec.Raw):
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError:
            return None
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _short(text: str) -> str:
    if len(text) <= _MAX_REASON:
        return text
    half = (_MAX_REASON - 1) // 2
    return text[:half] + "…" + text[-half:]


def json_schema_as_json_object(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (a chat request's, fields as sent) with a ``json_schema`` response_format
    rewritten as ``{"type": "json_object", "schema": …}``: the shape llama-cpp-python's server
    takes a JSON Schema in (it refuses ``json_schema``, and constrains its grammar to the
    schema given this way). Anything else is left as it is."""
    fmt = _decoded(body.get("response_format"))
    found = schema_of(CHAT_URL, fmt)
    if found is None:
        return body
    return {**body, "response_format": {"type": JSON_OBJECT, "schema": found[1]}}
