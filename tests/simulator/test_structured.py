"""The simulated engine's structured outputs over HTTP: ``response_format`` (chat, completions)
and ``text.format`` (Responses) honoured, and answers made off-format on demand."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from backfill.simulator.server import SimulatorConfig
from backfill.simulator.structured import instance
from tests.support import running_simulator

CONFIG = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=8)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 5, "maxLength": 7},
        "age": {"type": "integer", "exclusiveMinimum": 17},
        "score": {"type": "number", "maximum": -2.5},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 2},
        "nick": {"type": ["null", "string"]},
        "pet": {"anyOf": [{"$ref": "#/$defs/pet"}, {"type": "null"}]},
        "ok": {"type": "boolean"},
        "unused": {"type": "string"},
    },
    "required": ["name", "age", "score", "kind", "tags", "nick", "pet", "ok"],
    "additionalProperties": False,
    "$defs": {
        "tag": {"type": "string", "const": "x"},
        "pet": {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 4}},
                "required": ["legs"]},
    },
}  # fmt: skip


def chat(content: str, response_format: Any = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        **extra,
    }
    if response_format is not None:
        body["response_format"] = response_format
    return body


def schema_format(schema: Any = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


@asynccontextmanager
async def engine() -> AsyncIterator[httpx.AsyncClient]:
    async with (
        running_simulator(CONFIG) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        yield http


async def content_of(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    response = await http.post("/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    ChatCompletion.model_validate(data)
    choice = data["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_the_instance_of_a_schema_is_valid_against_it() -> None:
    value = instance(SCHEMA, SCHEMA)
    assert Draft202012Validator(SCHEMA).is_valid(value), value
    assert value["tags"] == ["x", "x"]
    assert value["age"] == 18
    assert value["pet"] == {"legs": 4}
    assert "unused" not in value


async def test_json_schema_and_json_object_are_honoured() -> None:
    async with engine() as http:
        schema_text, schema_finish = await content_of(http, chat("hi", schema_format()))
        object_text, _ = await content_of(http, chat("hi", {"type": "json_object"}))
        plain_text, _ = await content_of(http, chat("hi", {"type": "text"}))
        completion = await http.post(
            "/completions",
            json={"model": "sim-model", "prompt": "hi", "max_tokens": 16,
                  "response_format": {"type": "json_object"}},
        )  # fmt: skip
    assert schema_finish == "stop"
    assert Draft202012Validator(SCHEMA).is_valid(json.loads(schema_text)), schema_text
    assert json.loads(object_text) == {"answer": " ".join(["tok"] * 8)}
    assert plain_text == " ".join(["tok"] * 8)
    assert completion.status_code == 200, completion.text
    assert isinstance(json.loads(completion.json()["choices"][0]["text"]), dict)


async def test_directives_answer_off_the_format() -> None:
    async with engine() as http:
        off, _ = await content_of(http, chat("[[sim:off_schema]] hi", schema_format()))
        off_object, _ = await content_of(http, chat("[[sim:off_schema]]", {"type": "json_object"}))
        array = schema_format({"type": "array"})
        off_array, _ = await content_of(http, chat("[[sim:off_schema]] hi", array))
        prose, _ = await content_of(http, chat("[[sim:not_json]] hi", schema_format()))
    assert json.loads(off) == ["tok"] * 8
    assert not Draft202012Validator(SCHEMA).is_valid(json.loads(off))
    assert isinstance(json.loads(off_object), list)
    assert json.loads(off_array) == {"tok": " ".join(["tok"] * 8)}
    assert prose == " ".join(["tok"] * 8)


async def test_an_answer_cut_at_its_limit_is_incomplete_json() -> None:
    async with engine() as http:
        text, finish = await content_of(http, chat("hi", schema_format(), max_tokens=3))
    assert finish == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ("json", "response_format"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": 5}},
            "response_format.json_schema.schema",
        ),
    ],
)
async def test_a_malformed_format_is_refused(response_format: Any, param: str) -> None:
    async with engine() as http:
        response = await http.post("/chat/completions", json=chat("hi", response_format))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_responses_honour_text_format() -> None:
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA}
    body = {"model": "sim-model", "input": "hi", "max_output_tokens": 50, "text": {"format": fmt}}
    async with engine() as http:
        shaped = (await http.post("/responses", json=body)).json()
        plain = (await http.post("/responses", json={**body, "text": None})).json()
        refused = await http.post("/responses", json={**body, "text": {"form": {}}})
    Response.model_validate(shaped)
    text = shaped["output"][0]["content"][0]["text"]
    assert Draft202012Validator(SCHEMA).is_valid(json.loads(text)), text
    assert shaped["text"] == {"format": fmt}
    assert plain["text"] == {"format": {"type": "text"}}
    assert plain["output"][0]["content"][0]["text"] == " ".join(["tok"] * 8)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "form"
