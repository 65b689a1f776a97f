"""Fields of ``POST /v1/batches`` that cannot be honoured are refused with a named 400
(SPEC §4.1): nesting or integers the request encoder refuses, and a ``webhook_url`` that could
never be delivered to."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import InProcess, chat_line, jsonl


def nested(depth: int) -> bytes:
    """``{"a":{"a":…"leaf"…}}`` as JSON text (Python's own encoder stops near 1000 levels)."""
    return b'{"a":' * depth + b'"leaf"' + b"}" * depth


async def create_raw(bf: InProcess, file_id: str, field: str, value: bytes) -> Any:
    body = (
        b'{"input_file_id":"%s","endpoint":"/v1/chat/completions","completion_window":"24h",'
        b'"%s":%s}' % (file_id.encode(), field.encode(), value)
    )
    return await bf.client.post(
        "/v1/batches", content=body, headers={"content-type": "application/json"}
    )


async def input_file(bf: InProcess) -> str:
    response = await bf.upload(jsonl([chat_line("only")]))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


def assert_refused(response: Any, code: str, param: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("depth", [255, 500, 1020])
@pytest.mark.parametrize("field", ["metadata", "output_expires_after"])
async def test_deep_nesting_in_a_field_is_a_named_400(
    backfill: InProcess, field: str, depth: int
) -> None:
    response = await create_raw(backfill, await input_file(backfill), field, nested(depth))
    error = assert_refused(response, "invalid_value", field)
    assert f"'{field}'" in error["message"]
    assert "254 levels" in error["message"]
    assert (await backfill.client.get("/v1/batches")).json()["data"] == []


async def test_nesting_the_encoder_accepts_reaches_the_field_rules(backfill: InProcess) -> None:
    response = await create_raw(backfill, await input_file(backfill), "metadata", nested(200))
    error = assert_refused(response, "invalid_value", "metadata.a")
    assert "string" in error["message"]


async def test_an_undeliverable_webhook_url_is_refused(backfill: InProcess) -> None:
    file_id = await input_file(backfill)
    response = await backfill.create(file_id, webhook_url="http://example.com/hook")
    error = assert_refused(response, "invalid_value", "webhook_url")
    assert "'webhook_url' must be an HTTPS URL on a public host" in error["message"]
    assert (await backfill.client.get("/v1/batches")).json()["data"] == []
    # Leaving it out, or null, is fine.
    created = await backfill.create(file_id, webhook_url=None)
    assert created.status_code == 200, created.text
    assert created.json()["webhook_url"] is None
