"""At upload, a JSON Schema a line asks its answer to match must be a valid one, on every path
the validator takes through a file (the strict decoder, the fast path, the detailed checks)."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest

from backfill.domain.catalog import CatalogModel
from backfill.domain.input_format import Limits, LineError, LineValidator, request_body
from backfill.domain.money import Prices

MODEL = CatalogModel(
    "text-model",
    "text-v1",
    context_length=4096,
    max_output_tokens=1024,
    prices=Prices(100, 50, 400),
    endpoints=frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"}),
)
LIMITS = Limits(max_file_bytes=1 << 30, max_lines=10_000, max_line_bytes=1 << 20)
GOOD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BAD = {"type": "object", "properties": {"a": {"type": "integr"}}}


def chat_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def chat(n: int, response_format: Any = None) -> bytes:
    body: dict[str, Any] = {
        "model": "text-model",
        "messages": [{"role": "user", "content": f"question {n}"}],
        "max_tokens": 16,
    }
    if response_format is not None:
        body["response_format"] = response_format
    line = {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return orjson.dumps(line)


def check(lines: list[bytes]) -> list[str]:
    return LineValidator(LIMITS, {MODEL.id: MODEL}.get).check_lines(lines, 1)


def refused(lines: list[bytes]) -> LineError:
    with pytest.raises(LineError) as info:
        check(lines)
    return info.value


def test_lines_sharing_a_valid_schema_are_accepted_and_sent_as_written() -> None:
    lines = [chat(n, chat_format(GOOD)) for n in range(1, 301)]
    assert check(lines) == [f"r{n}" for n in range(1, 301)]
    assert msgspec.json.decode(request_body(lines[0])["response_format"]) == chat_format(GOOD)


@pytest.mark.parametrize("bad_line", [1, 2, 70, 300])
def test_an_invalid_schema_is_named_wherever_it_is(bad_line: int) -> None:
    # Past 64 lines the strict decoder has given up on a file whose lines carry a format;
    # lines without one keep coming in between.
    lines = [chat(n, chat_format(GOOD) if n % 3 else None) for n in range(1, 301)]
    lines[bad_line - 1] = chat(bad_line, chat_format(BAD))
    error = refused(lines)
    assert (error.code, error.line) == ("invalid_value", bad_line)
    assert error.param == "body.response_format.json_schema.schema"
    assert error.message.startswith(
        f"Line {bad_line}: 'body.response_format.json_schema.schema' is not a valid JSON "
        "Schema (at $.properties.a.type: "
    )


def test_each_distinct_schema_is_checked() -> None:
    lines = [chat(n, chat_format({**GOOD, "title": f"t{n}"})) for n in range(1, 50)]
    assert len(check(lines)) == 49
    lines.append(chat(50, chat_format({"minProperties": -1})))
    assert refused(lines).line == 50


def test_a_format_the_upload_does_not_know_reaches_the_engine_as_written() -> None:
    odd = {"type": "regex", "regex": "[a-z]+"}
    lines = [chat(1, odd), chat(2, "json"), chat(3, {"type": "json_schema"})]
    assert check(lines) == ["r1", "r2", "r3"]
    assert msgspec.json.decode(request_body(lines[0])["response_format"]) == odd


def test_completions_and_responses_lines_are_checked_too() -> None:
    completion = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "text-model", "prompt": "p", "max_tokens": 4,
                 "response_format": chat_format(BAD)},
    }  # fmt: skip
    error = refused([orjson.dumps(completion)])
    assert error.param == "body.response_format.json_schema.schema"
    response: dict[str, Any] = {
        "custom_id": "x1",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "text-model", "input": "p", "max_output_tokens": 4,
                 "text": {"format": {"type": "json_schema", "name": "o", "schema": BAD}}},
    }  # fmt: skip
    error = refused([orjson.dumps(response)])
    assert (error.param, error.line) == ("body.text.format.schema", 1)
    response["body"]["text"]["format"]["schema"] = GOOD
    assert check([orjson.dumps(response)]) == ["x1"]
