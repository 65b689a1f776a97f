"""Range and conditional-request edges of file downloads (RFC 9110), and HEAD."""

from __future__ import annotations

import httpx
import pytest

from tests.support import InProcess, chat_line, jsonl

CONTENT = "/v1/files/{}/content"


@pytest.fixture
async def file(backfill: InProcess) -> tuple[str, bytes]:
    content = jsonl([chat_line(f"q-{i}", f"question {i}") for i in range(20)])
    response = await backfill.upload(content)
    assert response.status_code == 200, response.text
    return response.json()["id"], content


@pytest.fixture
async def empty_file(backfill: InProcess) -> str:
    """The error file of a batch without errors: 0 bytes."""
    batch = await backfill.run_batch([chat_line("ok")])
    assert batch["status"] == "completed"
    response = await backfill.client.get(f"/v1/files/{batch['error_file_id']}")
    assert response.json()["bytes"] == 0
    file_id: str = batch["error_file_id"]
    return file_id


async def get(bf: InProcess, file_id: str, **headers: str) -> httpx.Response:
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    return await bf.client.get(CONTENT.format(file_id), headers=sent)


@pytest.mark.parametrize("range_", ["bytes=-5", "bytes=0-", "bytes=0-0", "bytes=3-"])
async def test_any_range_of_an_empty_file_is_the_whole_empty_file(
    backfill: InProcess, empty_file: str, range_: str
) -> None:
    response = await get(backfill, empty_file, range=range_)
    assert response.status_code == 200, response.text
    assert response.content == b""
    assert "content-range" not in response.headers
    assert response.headers["content-length"] == "0"


@pytest.mark.parametrize("start", ["size", "size+1", str(10**23)])
async def test_a_range_past_the_end_is_416(
    backfill: InProcess, file: tuple[str, bytes], start: str
) -> None:
    file_id, content = file
    first = {"size": len(content), "size+1": len(content) + 1}.get(start, start)
    response = await get(backfill, file_id, range=f"bytes={first}-")
    assert response.status_code == 416, response.text
    assert response.headers["content-range"] == f"bytes */{len(content)}"
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == "range_not_satisfiable"
    assert str(len(content)) in error["message"]


async def test_a_range_past_the_end_with_another_if_range_is_the_whole_file(
    backfill: InProcess, file: tuple[str, bytes]
) -> None:
    file_id, content = file
    response = await get(backfill, file_id, range=f"bytes={len(content)}-", if_range='"other"')
    assert response.status_code == 200
    assert response.content == content


@pytest.mark.parametrize(
    "header",
    ["*", 'W/"{etag}"', '"other", "{etag}"', 'W/"x",W/"{etag}"', ' "{etag}" '],
    ids=["star", "weak", "list", "weak list", "spaces"],
)
async def test_if_none_match_forms_are_honoured(
    backfill: InProcess, file: tuple[str, bytes], header: str
) -> None:
    file_id, _ = file
    etag = f'"{file_id}"'
    response = await get(backfill, file_id, if_none_match=header.format(etag=etag.strip('"')))
    assert response.status_code == 304
    assert response.content == b""
    assert response.headers["etag"] == etag


async def test_if_none_match_with_other_tags_sends_the_file(
    backfill: InProcess, file: tuple[str, bytes]
) -> None:
    file_id, content = file
    response = await get(backfill, file_id, if_none_match='"a", W/"b"')
    assert response.status_code == 200
    assert response.content == content


async def test_if_range_with_a_weak_tag_is_the_whole_file(
    backfill: InProcess, file: tuple[str, bytes]
) -> None:
    file_id, content = file
    response = await get(backfill, file_id, range="bytes=5-", if_range=f'W/"{file_id}"')
    assert response.status_code == 200
    assert response.content == content


@pytest.mark.parametrize("range_", [None, "bytes=5-14"])
async def test_head_sends_the_headers_of_get_without_a_body(
    backfill: InProcess, file: tuple[str, bytes], range_: str | None
) -> None:
    file_id, _ = file
    headers = {"Range": range_} if range_ else {}
    got = await backfill.client.get(CONTENT.format(file_id), headers=headers)
    head = await backfill.client.head(CONTENT.format(file_id), headers=headers)
    assert head.status_code == got.status_code == (206 if range_ else 200)
    assert head.content == b""
    for name in ("content-length", "content-range", "etag", "accept-ranges", "content-type"):
        assert head.headers.get(name) == got.headers.get(name), name


async def test_head_of_an_unknown_file_is_404(backfill: InProcess) -> None:
    response = await backfill.client.head(CONTENT.format("file-doesnotexist"))
    assert response.status_code == 404
