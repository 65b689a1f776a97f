"""Structured outputs over the HTTP API of an in-process Backfill with the simulated engine: the
upload refuses a schema that is not one, ``output_validation`` is a field of the create body
and of the batch object (and of the OpenAPI document), and a batch's answers are checked only
when it asks."""

from __future__ import annotations

from typing import Any

from tests.support import InProcess, chat_line, jsonl

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def line(custom_id: str, content: str = "hello", schema: Any = SCHEMA) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    return chat_line(custom_id, content, max_tokens=100, response_format=fmt)


async def test_an_invalid_schema_is_refused_at_upload_naming_line_and_field(
    backfill: InProcess,
) -> None:
    rows = [line("a"), line("b"), line("c", schema={"type": "object", "required": "n"})]
    response = await backfill.upload(jsonl(rows))
    assert response.status_code == 400, response.text
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value"
    assert error["line"] == 3
    assert error["param"] == "body.response_format.json_schema.schema"
    assert error["message"].startswith(
        "Line 3: 'body.response_format.json_schema.schema' is not a valid JSON Schema "
        "(at $.required: 'n' is not of type 'array')"
    )
    listed = (await backfill.client.get("/v1/files")).json()["data"]
    assert listed == []


async def test_output_validation_is_off_unless_asked_and_refused_when_not_a_boolean(
    backfill: InProcess,
) -> None:
    rows = [line("ok"), line("off", "[[sim:off_schema]] hello")]
    plain = await backfill.submit(rows)
    checked = await backfill.submit(rows, output_validation=True)
    uploaded = (await backfill.upload(jsonl(rows))).json()
    wrong = await backfill.create(uploaded["id"], output_validation="yes")
    plain_done = await backfill.wait(plain["id"])
    checked_done = await backfill.wait(checked["id"])
    errors = await backfill.rows(checked_done["error_file_id"])

    assert plain["output_validation"] is False
    assert checked["output_validation"] is True
    assert plain_done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert checked_done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
        ("off", "output_schema_mismatch")
    ]
    assert wrong.status_code == 400, wrong.text
    error = wrong.json()["error"]
    assert (error["param"], error["type"]) == ("output_validation", "invalid_request_error")
    assert "true or false" in error["message"]


async def test_the_openapi_document_describes_output_validation(backfill: InProcess) -> None:
    spec = (await backfill.client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    create = schemas["CreateBatchRequest"]
    assert create["properties"]["output_validation"]["type"] == "boolean"
    assert "response_format" in create["properties"]["output_validation"]["description"]
    assert "output_validation" not in create.get("required", [])
    batch = schemas["Batch"]
    assert batch["properties"]["output_validation"]["type"] == "boolean"
    assert "output_validation" in batch["required"]
    operation = spec["paths"]["/v1/batches"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CreateBatchRequest"}
