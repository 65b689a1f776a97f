"""Structured outputs without I/O: what a line asks for, whether its schema is a valid one, and
whether an answer is what it asked for."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest

from backfill.domain.endpoints import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL
from backfill.domain.output_schema import (
    JSON_OBJECT,
    JSON_SCHEMA,
    Expected,
    expected,
    json_schema_as_json_object,
    mismatch,
    schema_problem,
)
from backfill.runner.replies import succeeded

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "maxLength": 8}},
}


def chat_format(schema: Any = PERSON) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def raw_body(**fields: Any) -> dict[str, Any]:
    """A body as the worker holds it: each field the line's own JSON (``request_body``)."""
    return {name: msgspec.Raw(orjson.dumps(value)) for name, value in fields.items()}


def chat_answer(*contents: str | None, finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
            }
            for i, content in enumerate(contents)
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }


def response_answer(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "object": "response",
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": text}]},
        ],
    }


def person_check() -> Expected:
    found = expected(CHAT_URL, raw_body(response_format=chat_format()))
    assert found is not None
    return found


# ---- what a line asks for -----------------------------------------------------------------


def test_a_chat_line_asks_through_response_format() -> None:
    found = person_check()
    assert (found.endpoint, found.kind, found.broken) == (CHAT_URL, JSON_SCHEMA, None)
    assert found.validator is not None
    as_object = expected(CHAT_URL, raw_body(response_format={"type": "json_object"}))
    assert as_object == Expected(CHAT_URL, JSON_OBJECT)


def test_decoded_bodies_are_read_like_raw_ones() -> None:
    decoded = expected(COMPLETIONS_URL, {"response_format": chat_format()})
    assert decoded is not None
    assert decoded.kind == JSON_SCHEMA
    assert decoded.validator is not None


def test_a_responses_line_asks_through_text_format() -> None:
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    found = expected(RESPONSES_URL, raw_body(text=text))
    assert found is not None
    assert found.kind == JSON_SCHEMA
    assert found.validator is not None
    # A chat field on a Responses line asks nothing.
    assert expected(RESPONSES_URL, raw_body(response_format=chat_format())) is None


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (CHAT_URL, {}),
        (CHAT_URL, {"response_format": {"type": "text"}}),
        (CHAT_URL, {"response_format": None}),
        (CHAT_URL, {"response_format": {"type": "regex", "regex": "a+"}}),
        (EMBEDDINGS_URL, {"response_format": {"type": "json_object"}}),
        (RESPONSES_URL, {"text": {"format": {"type": "text"}}}),
    ],
)
def test_lines_that_ask_for_nothing_checkable_are_not_checked(
    endpoint: str, body: dict[str, Any]
) -> None:
    assert expected(endpoint, raw_body(**body)) is None


def test_a_json_schema_without_a_schema_asks_for_any_json() -> None:
    found = expected(CHAT_URL, raw_body(response_format={"type": "json_schema"}))
    assert found == Expected(CHAT_URL, JSON_SCHEMA)
    assert found is not None
    assert mismatch(found, chat_answer("[1, 2]")) is None
    assert "is not JSON" in (mismatch(found, chat_answer("one, two")) or "")


# ---- whether a schema is a valid one ------------------------------------------------------


def test_valid_schemas_have_no_problem() -> None:
    assert schema_problem(PERSON) is None
    assert schema_problem(True) is None
    assert schema_problem({"$schema": "http://json-schema.org/draft-07/schema#"}) is None


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"type": "objekt"}, "at $.type"),
        ({"properties": {"n": {"minLength": -1}}}, "at $.properties.n.minLength"),
        ([{"type": "string"}], "not an array"),
        ("string", "not a string"),
    ],
)
def test_an_invalid_schema_is_told_where(schema: Any, said: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None
    assert said in problem


def test_a_schema_is_checked_against_the_draft_it_names() -> None:
    # Draft 4's exclusiveMinimum is a boolean; 2020-12's a number.
    bound = {"minimum": 0, "exclusiveMinimum": True}
    assert schema_problem({"$schema": "http://json-schema.org/draft-04/schema#", **bound}) is None
    assert schema_problem(bound) is not None


# ---- whether an answer is what was asked --------------------------------------------------


def test_a_matching_answer_passes() -> None:
    answer = chat_answer('{"name": "Ada", "age": 36, "tags": ["math"]}')
    assert mismatch(person_check(), answer) is None


def test_an_answer_that_is_not_json_says_so() -> None:
    why = mismatch(person_check(), chat_answer("Ada is 36."))
    assert why is not None
    assert why.startswith(
        "The answer does not match the line's body.response_format (json_schema): "
        "choices[0].message.content is not JSON"
    )


def test_an_answer_off_the_schema_names_the_path_of_the_error() -> None:
    why = mismatch(person_check(), chat_answer('{"name": "Ada", "age": "36"}'))
    assert why is not None
    assert "choices[0].message.content does not match the schema at $.age" in why
    assert "'36' is not of type 'integer'" in why
    nested = mismatch(person_check(), chat_answer('{"name": "A", "age": 1, "tags": ["x" , 7]}'))
    assert nested is not None
    assert "at $.tags[1]" in nested
    missing = mismatch(person_check(), chat_answer('{"name": "Ada"}'))
    assert missing is not None
    assert "'age' is a required property" in missing


def test_every_choice_is_checked() -> None:
    why = mismatch(person_check(), chat_answer('{"name": "A", "age": 1}', '{"name": "B"}'))
    assert why is not None
    assert "choices[1].message.content" in why


def test_a_cut_off_answer_is_a_mismatch_even_when_it_parses() -> None:
    answer = chat_answer('{"name": "Ada", "age": 36}', finish_reason="length")
    why = mismatch(person_check(), answer)
    assert why is not None
    assert "finish_reason 'length'" in why
    assert "max_completion_tokens" in why


def test_json_object_asks_for_an_object() -> None:
    check = Expected(CHAT_URL, JSON_OBJECT)
    assert mismatch(check, chat_answer('{"anything": [1]}')) is None
    why = mismatch(check, chat_answer("[1]"))
    assert why is not None
    assert "is an array, but json_object asks for a JSON object" in why


def test_a_refusal_or_no_content_is_a_mismatch() -> None:
    refused = chat_answer(None)
    refused["choices"][0]["message"]["refusal"] = "I cannot help with that."
    why = mismatch(person_check(), refused)
    assert why is not None
    assert "the model refused (I cannot help with that.)" in why
    empty = mismatch(person_check(), chat_answer(None))
    assert empty is not None
    assert "is null, not JSON text" in empty
    assert "no choices" in (mismatch(person_check(), {"choices": []}) or "")


def test_completions_answers_are_checked_in_their_text() -> None:
    found = expected(COMPLETIONS_URL, raw_body(response_format={"type": "json_object"}))
    assert found is not None
    answer = {"choices": [{"index": 0, "text": "not json", "finish_reason": "stop"}]}
    why = mismatch(found, answer)
    assert why is not None
    assert "choices[0].text is not JSON" in why
    answer["choices"][0]["text"] = '{"ok": true}'
    assert mismatch(found, answer) is None


def test_responses_answers_are_checked_in_their_output_text() -> None:
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    found = expected(RESPONSES_URL, raw_body(text=text))
    assert found is not None
    assert mismatch(found, response_answer('{"name": "Ada", "age": 36}')) is None
    why = mismatch(found, response_answer('{"name": 36, "age": 36}'))
    assert why is not None
    assert "body.text.format (json_schema): output_text does not match the schema at $.name" in why
    cut = mismatch(found, response_answer('{"name": "Ada", "age": 36}', status="incomplete"))
    assert cut is not None
    assert "incomplete (max_output_tokens)" in cut


def test_a_reference_outside_the_schema_is_never_fetched() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    found = expected(CHAT_URL, raw_body(response_format=chat_format(schema)))
    assert found is not None
    why = mismatch(found, chat_answer('{"a": 1}'))
    assert why is not None
    assert "'https://example.com/a.json', which is not inside the schema" in why


def test_a_line_whose_schema_is_broken_mismatches_every_answer() -> None:
    # A line uploaded before schemas were checked at upload.
    found = expected(CHAT_URL, raw_body(response_format=chat_format({"type": 5})))
    assert found is not None
    assert found.broken is not None
    why = mismatch(found, chat_answer("{}"))
    assert why is not None
    assert "the line's schema is not valid: at $.type" in why


# ---- the row it becomes -------------------------------------------------------------------


def test_a_mismatch_becomes_a_charged_error_row_that_keeps_the_answer() -> None:
    answer = chat_answer('{"name": "Ada", "age": "old"}')
    outcome = succeeded("line-1", orjson.dumps(answer), None, person_check())
    row = orjson.loads(outcome.row)
    assert (outcome.ok, outcome.billed) == (False, True)
    assert (outcome.input_tokens, outcome.output_tokens) == (7, 5)
    assert outcome.request_id is not None
    assert row["custom_id"] == "line-1"
    assert row["response"] == {
        "status_code": 200,
        "request_id": outcome.request_id,
        "body": answer,
    }
    assert row["error"]["code"] == "output_schema_mismatch"
    assert "at $.age" in row["error"]["message"]


def test_a_matching_answer_is_an_ordinary_success_row() -> None:
    answer = chat_answer('{"name": "Ada", "age": 36}')
    outcome = succeeded("line-1", orjson.dumps(answer), None, person_check())
    row = orjson.loads(outcome.row)
    assert (outcome.ok, outcome.billed) == (True, False)
    assert row["error"] is None
    assert row["response"]["body"] == answer


def test_a_long_reason_keeps_what_was_expected() -> None:
    words = orjson.dumps(["tok"] * 200).decode()
    why = mismatch(person_check(), chat_answer(words))
    assert why is not None
    assert "…" in why
    assert why.endswith("is not of type 'object'.")
    assert len(why) < 500


# ---- llama-cpp-python's shape -------------------------------------------------------------


def test_a_json_schema_is_sent_inside_json_object_where_the_engine_needs_it() -> None:
    body = raw_body(model="m", response_format=chat_format())
    sent = json_schema_as_json_object(body)
    assert sent["response_format"] == {"type": "json_object", "schema": PERSON}
    assert sent["model"] is body["model"]
    # The line's own body is left as it was: the answer is checked against it.
    assert msgspec.json.decode(body["response_format"]) == chat_format()
    for kept in ({"type": "json_object"}, {"type": "json_schema"}, {"type": "text"}):
        as_sent = raw_body(response_format=kept)
        assert json_schema_as_json_object(as_sent) is as_sent


def test_a_schema_whose_draft_is_not_a_uri_is_refused() -> None:
    assert schema_problem({"$schema": ["x"]}) == (
        "at $['$schema']: it must be the URI of a JSON Schema draft"
    )
    # An unknown draft is read as 2020-12, as jsonschema reads it.
    assert schema_problem({"$schema": "https://example.com/my-draft", "type": "object"}) is None


def test_json_object_with_a_schema_is_checked_against_it() -> None:
    # llama-cpp-python's own shape, written by a line itself.
    found = expected(CHAT_URL, raw_body(response_format={"type": "json_object", "schema": PERSON}))
    assert found is not None
    assert (found.kind, found.validator is not None) == (JSON_OBJECT, True)
    assert mismatch(found, chat_answer('{"name": "Ada", "age": 36}')) is None
    why = mismatch(found, chat_answer('{"name": "Ada"}'))
    assert why is not None
    assert "body.response_format (json_object)" in why
    assert "'age' is a required property" in why
    assert "json_object asks for a JSON object" in (mismatch(found, chat_answer("[]")) or "")
