"""Upload validation over HTTP (SPEC §3.1, §3.2, §5): one test per rule, all or nothing."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backfill.settings import ModelSettings
from tests.support import SIM_MODEL, SIM_PRICES, InProcess, Sim, backfill_with, chat_line, jsonl

FILE_FIELDS = {
    "id",
    "object",
    "bytes",
    "created_at",
    "expires_at",
    "filename",
    "purpose",
    "status",
    "status_details",
}
MODELS = [
    ModelSettings(
        id=SIM_MODEL,
        model_config_id="sim-model-v1",
        context_length=4096,
        max_output_tokens=1024,
        batch=SIM_PRICES,
    ),
    ModelSettings(
        id="other-model", model_config_id="other-v1", max_output_tokens=1024, batch=SIM_PRICES
    ),
    ModelSettings(id="no-batch-model", model_config_id="no-batch-v1", batch=None),
]


def good(n: int = 3) -> list[dict[str, Any]]:
    return [chat_line(f"req-{i}", f"question {i}") for i in range(1, n + 1)]


def with_line(line_no: int, row: dict[str, Any], n: int = 3) -> bytes:
    """``n`` good lines, line ``line_no`` (1-based) replaced by ``row``."""
    rows = good(n)
    rows[line_no - 1] = row
    return jsonl(rows)


def with_raw_line(line_no: int, raw: bytes, n: int = 3) -> bytes:
    lines = jsonl(good(n)).splitlines()
    lines[line_no - 1] = raw
    return b"\n".join(lines) + b"\n"


def changed(custom_id: str, **body: Any) -> dict[str, Any]:
    """A good chat line with body fields replaced; a value of ``None`` removes the field."""
    row = chat_line(custom_id)
    for key, value in body.items():
        if value is None:
            row["body"].pop(key, None)
        else:
            row["body"][key] = value
    return row


def without(row: dict[str, Any], key: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    del out[key]
    return out


def assert_rejected(
    response: httpx.Response,
    code: str,
    *,
    line: int | None,
    param: str | None,
    names_line: bool = True,
) -> dict[str, Any]:
    """A 400 in the OpenAI envelope, with the code, the 1-based line and the field named."""
    assert response.status_code == 400, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert set(error) <= {"message", "type", "param", "code", "line"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code, error
    assert error["param"] == param, error
    assert error.get("line") == line, error
    message = error["message"]
    assert isinstance(message, str)
    assert message
    if line is not None and names_line:
        assert re.search(rf"\bline {line}\b", message, re.IGNORECASE), message
    if param is not None:
        assert param in message, message
    return error


async def assert_nothing_stored(bf: InProcess) -> None:
    listed = await bf.client.get("/v1/files")
    assert listed.status_code == 200, listed.text
    assert listed.json()["data"] == []
    blobs = bf.settings.data_dir / "blobs"
    stored = [p for p in blobs.rglob("*") if p.is_file()]
    assert stored == []
    tmp = blobs / ".tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []


# ---- §5.1 line structure -----------------------------------------------------------------


async def test_invalid_json_line(backfill: InProcess) -> None:
    response = await backfill.upload(with_raw_line(2, b'{"custom_id": "req-2", "method":'))
    assert_rejected(response, "invalid_json_line", line=2, param=None)


async def test_line_that_is_not_a_json_object(backfill: InProcess) -> None:
    response = await backfill.upload(with_raw_line(2, b'["req-2", "POST"]'))
    assert_rejected(response, "invalid_json_line", line=2, param=None)


async def test_blank_line_in_the_middle(backfill: InProcess) -> None:
    response = await backfill.upload(with_raw_line(2, b""))
    assert_rejected(response, "invalid_json_line", line=2, param=None)


async def test_blank_line_at_the_end(backfill: InProcess) -> None:
    """Only one final newline is allowed; a second one is a blank line."""
    response = await backfill.upload(jsonl(good(2)) + b"\n")
    assert_rejected(response, "invalid_json_line", line=3, param=None)


async def test_whitespace_only_line(backfill: InProcess) -> None:
    response = await backfill.upload(with_raw_line(3, b"  \t "))
    assert_rejected(response, "invalid_json_line", line=3, param=None)


async def test_non_utf8_bytes(backfill: InProcess) -> None:
    raw = orjson.dumps(chat_line("req-2", "caf\u00e9")).replace(b"\xc3\xa9", b"\xe9")
    response = await backfill.upload(with_raw_line(2, raw))
    assert_rejected(response, "invalid_json_line", line=2, param=None)


async def test_byte_order_mark_is_named(backfill: InProcess) -> None:
    response = await backfill.upload(b"\xef\xbb\xbf" + jsonl(good(2)))
    error = assert_rejected(response, "invalid_json_line", line=1, param=None)
    assert "byte order mark" in error["message"]


async def test_unknown_top_level_key(backfill: InProcess) -> None:
    row = chat_line("req-2")
    row["metadata"] = {"a": "b"}
    response = await backfill.upload(with_line(2, row))
    assert_rejected(response, "invalid_value", line=2, param="metadata")


@pytest.mark.parametrize("key", ["custom_id", "method", "url", "body"])
async def test_missing_top_level_field(backfill: InProcess, key: str) -> None:
    response = await backfill.upload(with_line(3, without(chat_line("req-3"), key)))
    assert_rejected(response, "missing_required_parameter", line=3, param=key)


async def test_method_not_post(backfill: InProcess) -> None:
    row = chat_line("req-2")
    row["method"] = "GET"
    response = await backfill.upload(with_line(2, row))
    assert_rejected(response, "invalid_value", line=2, param="method")


async def test_bad_url(backfill: InProcess) -> None:
    row = chat_line("req-2")
    row["url"] = "/v1/embeddings"
    response = await backfill.upload(with_line(2, row))
    assert_rejected(response, "invalid_url", line=2, param="url")


async def test_url_differs_from_earlier_lines(backfill: InProcess) -> None:
    row = {
        "custom_id": "req-2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": SIM_MODEL, "prompt": "hi", "max_tokens": 4},
    }
    response = await backfill.upload(with_line(2, row))
    assert_rejected(response, "invalid_url", line=2, param="url")


async def test_duplicate_custom_id(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(3, chat_line("req-1"), n=4))
    error = assert_rejected(response, "duplicate_custom_id", line=3, param="custom_id")
    assert "req-1" in error["message"]


async def test_custom_id_over_128_bytes(backfill: InProcess) -> None:
    # 65 two-byte characters: 65 characters but 130 UTF-8 bytes.
    response = await backfill.upload(with_line(2, chat_line("\u00e9" * 65)))
    assert_rejected(response, "invalid_value", line=2, param="custom_id")


async def test_empty_custom_id(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, chat_line("")))
    assert_rejected(response, "invalid_value", line=2, param="custom_id")


# ---- §5.2 model ----------------------------------------------------------------------------


async def test_unknown_model(backfill: InProcess) -> None:
    rows = [chat_line(f"req-{i}", model="gpt-unknown") for i in range(1, 4)]
    response = await backfill.upload(jsonl(rows))
    error = assert_rejected(response, "model_not_found", line=1, param="body.model")
    assert "gpt-unknown" in error["message"]


async def test_model_with_batch_disabled(tmp_path: Path, sim: Sim) -> None:
    async with backfill_with(tmp_path, sim, models=MODELS) as bf:
        rows = [chat_line(f"req-{i}", model="no-batch-model") for i in range(1, 4)]
        response = await bf.upload(jsonl(rows))
        error = assert_rejected(response, "model_not_found", line=1, param="body.model")
        assert "no-batch-model" in error["message"]


async def test_mixed_models(tmp_path: Path, sim: Sim) -> None:
    async with backfill_with(tmp_path, sim, models=MODELS) as bf:
        response = await bf.upload(with_line(3, chat_line("req-3", model="other-model"), n=4))
        error = assert_rejected(response, "mixed_models", line=3, param="body.model")
        assert "other-model" in error["message"]


# ---- §5.3 max tokens, stream ---------------------------------------------------------------


async def test_missing_max_tokens(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, changed("req-2", max_tokens=None)))
    assert_rejected(response, "missing_required_parameter", line=2, param="body.max_tokens")


async def test_max_tokens_over_the_model_limit(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, changed("req-2", max_tokens=1025)))
    error = assert_rejected(response, "invalid_value", line=2, param="body.max_tokens")
    assert "1024" in error["message"]


async def test_max_completion_tokens_over_the_model_limit(backfill: InProcess) -> None:
    row = changed("req-2", max_tokens=None, max_completion_tokens=5000)
    response = await backfill.upload(with_line(2, row))
    assert_rejected(response, "invalid_value", line=2, param="body.max_completion_tokens")


async def test_max_tokens_zero(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, changed("req-2", max_tokens=0)))
    assert_rejected(response, "invalid_value", line=2, param="body.max_tokens")


async def test_stream_true(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, changed("req-2", stream=True)))
    assert_rejected(response, "streaming_unsupported", line=2, param="body.stream")


# ---- §5.4 messages, prompt, modalities -----------------------------------------------------


async def test_empty_messages(backfill: InProcess) -> None:
    response = await backfill.upload(with_line(2, changed("req-2", messages=[])))
    assert_rejected(response, "missing_required_parameter", line=2, param="body.messages")


async def test_bad_role(backfill: InProcess) -> None:
    messages = [{"role": "system", "content": "x"}, {"role": "robot", "content": "y"}]
    response = await backfill.upload(with_line(2, changed("req-2", messages=messages)))
    assert_rejected(response, "invalid_value", line=2, param="body.messages[1].role")


async def test_completions_without_prompt(backfill: InProcess) -> None:
    rows: list[dict[str, Any]] = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SIM_MODEL, "prompt": f"p{i}", "max_tokens": 4},
        }
        for i in range(1, 4)
    ]
    del rows[1]["body"]["prompt"]
    response = await backfill.upload(jsonl(rows))
    assert_rejected(response, "missing_required_parameter", line=2, param="body.prompt")


async def test_image_part(backfill: InProcess) -> None:
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    messages = [{"role": "user", "content": content}]
    response = await backfill.upload(with_line(2, changed("req-2", messages=messages)))
    assert_rejected(response, "unsupported_modality", line=2, param="body.messages[0].content[1]")


async def test_audio_part(backfill: InProcess) -> None:
    content = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    messages = [{"role": "user", "content": content}]
    response = await backfill.upload(with_line(2, changed("req-2", messages=messages)))
    assert_rejected(response, "unsupported_modality", line=2, param="body.messages[0].content[0]")


# ---- §5.5 limits ---------------------------------------------------------------------------


async def test_line_too_large(tmp_path: Path, sim: Sim) -> None:
    async with backfill_with(tmp_path, sim, max_line_bytes=400) as bf:
        response = await bf.upload(with_line(2, chat_line("req-2", "x" * 500)))
        assert_rejected(response, "line_too_large", line=2, param=None)
        await assert_nothing_stored(bf)


async def test_file_too_large(tmp_path: Path, sim: Sim) -> None:
    rows = [chat_line(f"req-{i:03d}") for i in range(1, 11)]
    line_bytes = len(jsonl(rows[:1]))
    assert {len(jsonl([r])) for r in rows} == {line_bytes}
    # The limit falls in the middle of line 3.
    async with backfill_with(tmp_path, sim, max_file_bytes=2 * line_bytes + line_bytes // 2) as bf:
        response = await bf.upload(jsonl(rows))
        assert_rejected(response, "file_too_large", line=3, param=None)
        await assert_nothing_stored(bf)


async def test_too_many_lines(tmp_path: Path, sim: Sim) -> None:
    async with backfill_with(tmp_path, sim, max_lines=3) as bf:
        ok = await bf.upload(jsonl(good(3)))
        assert ok.status_code == 200, ok.text
        response = await bf.upload(jsonl(good(5)))
        assert_rejected(response, "too_many_requests_in_file", line=4, param=None)


# ---- the form ------------------------------------------------------------------------------


async def test_purpose_missing(backfill: InProcess) -> None:
    response = await backfill.client.post(
        "/v1/files", files={"file": ("input.jsonl", jsonl(good()), "application/jsonl")}
    )
    assert_rejected(response, "missing_required_parameter", line=None, param="purpose")
    await assert_nothing_stored(backfill)


async def test_purpose_wrong(backfill: InProcess) -> None:
    response = await backfill.upload(jsonl(good()), purpose="fine-tune")
    error = assert_rejected(response, "invalid_value", line=None, param="purpose")
    assert "fine-tune" in error["message"]
    await assert_nothing_stored(backfill)


async def test_purpose_batch_output_cannot_be_uploaded(backfill: InProcess) -> None:
    response = await backfill.upload(jsonl(good()), purpose="batch_output")
    assert_rejected(response, "invalid_value", line=None, param="purpose")


async def test_empty_file(backfill: InProcess) -> None:
    response = await backfill.upload(b"")
    assert_rejected(response, "invalid_json_line", line=1, param="file", names_line=False)
    await assert_nothing_stored(backfill)


async def test_file_part_missing(backfill: InProcess) -> None:
    response = await backfill.client.post("/v1/files", files={"purpose": (None, b"batch")})
    assert_rejected(response, "missing_required_parameter", line=None, param="file")
    await assert_nothing_stored(backfill)


async def test_body_not_multipart(backfill: InProcess) -> None:
    response = await backfill.client.post("/v1/files", json={"purpose": "batch"})
    assert_rejected(response, "invalid_value", line=None, param="file")
    await assert_nothing_stored(backfill)


# ---- all or nothing --------------------------------------------------------------------------


async def test_rejected_uploads_store_nothing(backfill: InProcess) -> None:
    # Big enough that encrypted segments (1 MiB) were written before the bad last line.
    rows = [chat_line(f"req-{i}", "y" * 1000) for i in range(3000)]
    rows.append(chat_line("req-0"))
    big = jsonl(rows)
    assert len(big) > 3 * 1024 * 1024
    bad_files = [
        big,
        with_raw_line(2, b"{"),
        with_line(3, chat_line("req-1")),
        jsonl(good(2)) + b"\n",
        b"",
    ]
    for content in bad_files:
        response = await backfill.upload(content)
        assert response.status_code == 400, response.text
    error = assert_rejected(
        await backfill.upload(big), "duplicate_custom_id", line=3001, param="custom_id"
    )
    assert "req-0" in error["message"]
    await assert_nothing_stored(backfill)
    # The service is still fine afterwards: a good upload lists exactly one file.
    ok = await backfill.upload(jsonl(good()))
    assert ok.status_code == 200, ok.text
    listed = (await backfill.client.get("/v1/files")).json()
    assert [f["id"] for f in listed["data"]] == [ok.json()["id"]]


# ---- accepted files --------------------------------------------------------------------------


@pytest.mark.parametrize("final_newline", [True, False])
async def test_valid_file_is_processed(backfill: InProcess, final_newline: bool) -> None:
    content = jsonl(good(5))
    if not final_newline:
        content = content[:-1]
    response = await backfill.upload(content)
    assert response.status_code == 200, response.text
    file = response.json()
    assert set(file) == FILE_FIELDS
    assert file["id"].startswith("file")
    assert file["object"] == "file"
    assert file["bytes"] == len(content)
    assert file["purpose"] == "batch"
    assert file["status"] == "processed"
    assert file["status_details"] is None
    assert isinstance(file["filename"], str)
    assert file["filename"]
    assert "input" not in file["filename"]  # server-assigned, the upload name is not kept
    assert isinstance(file["created_at"], int)
    assert isinstance(file["expires_at"], int)
    assert file["expires_at"] - file["created_at"] == backfill.settings.limits.input_file_ttl_s

    fetched = await backfill.client.get(f"/v1/files/{file['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == file
    listed = (await backfill.client.get("/v1/files")).json()
    assert listed["data"] == [file]
    downloaded = await backfill.client.get(f"/v1/files/{file['id']}/content")
    assert downloaded.content == content


async def test_crlf_line_endings_are_accepted(backfill: InProcess) -> None:
    rows = good(4)
    content = b"".join(orjson.dumps(r) + b"\r\n" for r in rows)
    response = await backfill.upload(content)
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["status"] == "processed"
    assert file["bytes"] == len(content)

    created = await backfill.create(file["id"])
    assert created.status_code == 200, created.text
    assert created.json()["request_counts"]["total"] == 4
    batch = await backfill.wait(created.json()["id"])
    assert batch["status"] == "completed"
    out = await backfill.rows(batch["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(r["custom_id"] for r in rows)


async def test_crlf_without_final_newline_is_accepted(backfill: InProcess) -> None:
    content = b"\r\n".join(orjson.dumps(r) for r in good(3))
    response = await backfill.upload(content)
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == len(content)
