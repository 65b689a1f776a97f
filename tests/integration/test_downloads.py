"""Files API over HTTP: downloads with ETag/Range, listing, retrieval and deletion (SPEC §3)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support import InProcess, chat_line, jsonl

CONTENT = "/v1/files/{}/content"


async def upload(backfill: InProcess, rows: int = 20, tag: str = "q") -> tuple[str, bytes]:
    content = jsonl([chat_line(f"{tag}-{i}", f"question number {i}") for i in range(rows)])
    response = await backfill.upload(content)
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id, content


@pytest.fixture
async def uploaded(backfill: InProcess) -> tuple[str, bytes]:
    return await upload(backfill)


async def download(backfill: InProcess, file_id: str, **headers: str) -> httpx.Response:
    """GET the content; ``if_range="x"`` sends ``If-Range: x``."""
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    return await backfill.client.get(CONTENT.format(file_id), headers=sent)


def assert_non_retryable(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers.get("x-request-id")
    error: dict[str, Any] = response.json()["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


# ---- content ----------------------------------------------------------------------------


async def test_content_has_strong_etag_and_accept_ranges(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    file_id, content = uploaded
    response = await download(backfill, file_id)
    assert response.status_code == 200
    assert response.content == content
    etag = response.headers["etag"]
    assert etag.startswith('"')
    assert etag.endswith('"')
    assert not etag.startswith("W/")
    assert len(etag) > 2
    assert response.headers["accept-ranges"] == "bytes"
    assert response.headers["content-type"].split(";")[0].strip() == "application/jsonl"
    assert int(response.headers["content-length"]) == len(content)


async def test_etag_is_stable_and_distinct_per_file(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    file_id, _ = uploaded
    other_id, _ = await upload(backfill, tag="other")
    first = (await download(backfill, file_id)).headers["etag"]
    again = (await download(backfill, file_id)).headers["etag"]
    other = (await download(backfill, other_id)).headers["etag"]
    assert first == again
    assert first != other


@pytest.mark.parametrize("start", [0, 1, 17, -1])
async def test_range_with_matching_if_range_is_partial(
    backfill: InProcess, uploaded: tuple[str, bytes], start: int
) -> None:
    file_id, content = uploaded
    start = start if start >= 0 else len(content) - 1
    etag = (await download(backfill, file_id)).headers["etag"]
    response = await download(backfill, file_id, range=f"bytes={start}-", if_range=etag)
    assert response.status_code == 206
    assert response.content == content[start:]
    assert response.headers["content-range"] == f"bytes {start}-{len(content) - 1}/{len(content)}"
    assert int(response.headers["content-length"]) == len(content) - start
    assert response.headers["etag"] == etag
    assert response.headers["content-type"].split(";")[0].strip() == "application/jsonl"


async def test_range_with_mismatching_if_range_is_the_full_file(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    file_id, content = uploaded
    etag = (await download(backfill, file_id)).headers["etag"]
    response = await download(backfill, file_id, range="bytes=10-", if_range='"not-the-etag"')
    assert response.status_code == 200
    assert response.content == content
    assert "content-range" not in response.headers
    assert response.headers["etag"] == etag


async def test_range_without_if_range_is_partial(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    file_id, content = uploaded
    response = await download(backfill, file_id, range="bytes=100-")
    assert response.status_code == 206
    assert response.content == content[100:]
    assert response.headers["content-range"] == f"bytes 100-{len(content) - 1}/{len(content)}"


async def test_closed_range_is_the_exact_slice(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    file_id, content = uploaded
    response = await download(backfill, file_id, range="bytes=5-49")
    assert response.status_code == 206
    assert response.content == content[5:50]
    assert response.headers["content-range"] == f"bytes 5-49/{len(content)}"


async def test_resume_reassembles_the_file(
    backfill: InProcess, uploaded: tuple[str, bytes]
) -> None:
    """What a client does after a dropped connection: fetch the rest and append it."""
    file_id, content = uploaded
    etag = (await download(backfill, file_id)).headers["etag"]
    got = content[:123]
    rest = await download(backfill, file_id, range=f"bytes={len(got)}-", if_range=etag)
    assert rest.status_code == 206
    assert got + rest.content == content


async def test_repeated_downloads_are_byte_identical(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line(f"r-{i}", f"q {i}") for i in range(10)])
    assert batch["status"] == "completed"
    output_id = batch["output_file_id"]
    first = await download(backfill, output_id)
    assert first.status_code == 200
    assert first.content.count(b"\n") == 10
    for _ in range(3):
        again = await download(backfill, output_id)
        assert again.content == first.content
        assert again.headers["etag"] == first.headers["etag"]
    tail = await download(backfill, output_id, range="bytes=7-", if_range=first.headers["etag"])
    assert tail.status_code == 206
    assert tail.content == first.content[7:]


@pytest.mark.parametrize(
    "accept", ["application/binary", "application/octet-stream", "*/*", "text/html"]
)
async def test_any_accept_header_is_served(
    backfill: InProcess, uploaded: tuple[str, bytes], accept: str
) -> None:
    file_id, content = uploaded
    response = await download(backfill, file_id, accept=accept)
    assert response.status_code == 200
    assert response.content == content


async def test_content_of_unknown_file_is_404(backfill: InProcess) -> None:
    error = assert_non_retryable(await download(backfill, "file-doesnotexist"), 404)
    assert error["type"] == "invalid_request_error"


# ---- listing and retrieval --------------------------------------------------------------


async def test_file_object(backfill: InProcess, uploaded: tuple[str, bytes]) -> None:
    file_id, content = uploaded
    response = await backfill.client.get(f"/v1/files/{file_id}")
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == file_id
    assert body["object"] == "file"
    assert body["bytes"] == len(content)
    assert body["purpose"] == "batch"
    assert body["status"] == "processed"
    assert body["status_details"] is None
    assert isinstance(body["created_at"], int)
    assert isinstance(body["filename"], str)
    assert body["filename"] != "input.jsonl"  # server-assigned (SPEC §3.2)
    assert body["expires_at"] is None or body["expires_at"] > body["created_at"]


async def test_list_envelope_and_paging(backfill: InProcess) -> None:
    ids = [(await upload(backfill, 2, tag=f"f{n}"))[0] for n in range(5)]
    newest_first = ids[::-1]

    listed = (await backfill.client.get("/v1/files")).json()
    assert listed["object"] == "list"
    assert [f["id"] for f in listed["data"]] == newest_first
    assert listed["first_id"] == newest_first[0]
    assert listed["last_id"] == newest_first[-1]
    assert listed["has_more"] is False
    assert all(f["object"] == "file" for f in listed["data"])

    page = (await backfill.client.get("/v1/files", params={"limit": 2})).json()
    assert [f["id"] for f in page["data"]] == newest_first[:2]
    assert page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (newest_first[0], newest_first[1])

    seen = [f["id"] for f in page["data"]]
    while page["has_more"]:
        page = (
            await backfill.client.get("/v1/files", params={"limit": 2, "after": page["last_id"]})
        ).json()
        assert isinstance(page["has_more"], bool)
        seen += [f["id"] for f in page["data"]]
    assert seen == newest_first

    asc = (await backfill.client.get("/v1/files", params={"order": "asc"})).json()
    assert [f["id"] for f in asc["data"]] == ids
    asc_page = (
        await backfill.client.get("/v1/files", params={"order": "asc", "after": ids[1]})
    ).json()
    assert [f["id"] for f in asc_page["data"]] == ids[2:]


async def test_empty_list(backfill: InProcess) -> None:
    listed = (await backfill.client.get("/v1/files")).json()
    assert listed == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


async def test_list_filters_by_purpose(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("only", "q")])
    outputs = (await backfill.client.get("/v1/files", params={"purpose": "batch_output"})).json()
    assert {f["id"] for f in outputs["data"]} == {batch["output_file_id"], batch["error_file_id"]}
    unused = (await backfill.upload(jsonl([chat_line("unused", "q")]))).json()
    inputs = (await backfill.client.get("/v1/files", params={"purpose": "batch"})).json()
    # The finished batch's input went at completion (SPEC §10.3); the unused one is kept.
    assert [f["id"] for f in inputs["data"]] == [unused["id"]]


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "10001"}, {"order": "sideways"}])
async def test_bad_list_parameters_are_400(backfill: InProcess, params: dict[str, str]) -> None:
    response = await backfill.client.get("/v1/files", params=params)
    assert_non_retryable(response, 400)


# ---- deletion ---------------------------------------------------------------------------


async def test_delete_then_404(backfill: InProcess, uploaded: tuple[str, bytes]) -> None:
    file_id, _ = uploaded
    response = await backfill.client.delete(f"/v1/files/{file_id}")
    assert response.status_code == 200
    assert response.json() == {"id": file_id, "object": "file", "deleted": True}

    assert_non_retryable(await backfill.client.get(f"/v1/files/{file_id}"), 404)
    assert_non_retryable(await download(backfill, file_id), 404)
    assert_non_retryable(await backfill.client.delete(f"/v1/files/{file_id}"), 404)
    listed = (await backfill.client.get("/v1/files")).json()
    assert file_id not in [f["id"] for f in listed["data"]]
    # A deleted file cannot feed a batch.
    assert_non_retryable(await backfill.create(file_id), 404)


async def test_delete_result_files(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a", "q")])
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        response = await backfill.client.delete(f"/v1/files/{file_id}")
        assert response.json() == {"id": file_id, "object": "file", "deleted": True}
        assert_non_retryable(await download(backfill, file_id), 404)


async def test_input_of_an_unfinished_batch_cannot_be_deleted(backfill: InProcess) -> None:
    content = jsonl([chat_line("slow", "take your time [[sim:delay_ms=3000]]")])
    file_id = (await backfill.upload(content)).json()["id"]
    created = await backfill.create(file_id)
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    error = assert_non_retryable(await backfill.client.delete(f"/v1/files/{file_id}"), 409)
    assert batch_id in error["message"]
    # Still there, content intact.
    assert (await backfill.client.get(f"/v1/files/{file_id}")).status_code == 200
    assert (await download(backfill, file_id)).content == content

    cancelled = await backfill.client.post(f"/v1/batches/{batch_id}/cancel", json={})
    assert cancelled.status_code == 200
    final = await backfill.wait(batch_id, timeout_s=30)
    assert final["status"] == "cancelled"
    deleted = await backfill.client.delete(f"/v1/files/{file_id}")
    assert deleted.status_code == 200
    assert deleted.json()["deleted"] is True
