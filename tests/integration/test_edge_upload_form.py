"""An upload form carries one file: a second ``file`` part is refused, nothing stored."""

from __future__ import annotations

from tests.support import InProcess, chat_line, jsonl


async def test_second_file_part_is_refused_and_nothing_is_stored(backfill: InProcess) -> None:
    boundary = "edgeboundary"
    parts = [
        ("purpose", None, b"batch"),
        ("file", "a.jsonl", jsonl([chat_line("a"), chat_line("b")])),
        ("file", "b.jsonl", jsonl([chat_line("c")])),
    ]
    body = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        body += value + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    response = await backfill.client.post(
        "/v1/files",
        content=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file"
    assert "more than one 'file' part" in error["message"]
    assert (await backfill.client.get("/v1/files")).json()["data"] == []
    blobs = backfill.settings.data_dir / "blobs"
    assert [p for p in blobs.rglob("*") if p.is_file()] == []
