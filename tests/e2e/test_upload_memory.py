"""Uploads are streamed: the server's peak memory does not grow with the file (SPEC §3.1)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support import SIM_MODEL, ServerProcess

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
SMALL = 8 * MiB
BIG = 96 * MiB
# Peak RSS may grow by this much from the small to the big upload (the files differ by 88 MiB).
ALLOWED_GROWTH = 40 * MiB
CHUNK = 1 * MiB


def _line(i: int, filler: str) -> bytes:
    return (
        orjson.dumps(
            {
                "custom_id": f"req-{i:09d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": filler}],
                    "max_tokens": 8,
                },
            }
        )
        + b"\n"
    )


def jsonl_stream(size: int) -> tuple[Iterator[bytes], int]:
    """About ``size`` bytes of valid request lines, produced chunk by chunk (never held)."""
    filler = "lorem ipsum " * 170  # ~2 KiB lines
    line_len = len(_line(0, filler))
    count = size // line_len

    def chunks() -> Iterator[bytes]:
        batch: list[bytes] = []
        held = 0
        for i in range(count):
            line = _line(i, filler)
            batch.append(line)
            held += len(line)
            if held >= CHUNK:
                yield b"".join(batch)
                batch, held = [], 0
        if batch:
            yield b"".join(batch)

    return chunks(), count * line_len


def multipart(content: Iterator[bytes]) -> tuple[str, Iterator[bytes]]:
    boundary = secrets.token_hex(16)
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        'filename="big.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def body() -> Iterator[bytes]:
        yield head
        yield from content
        yield tail

    return f"multipart/form-data; boundary={boundary}", body()


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM) in bytes."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            value, unit = row.split()[1:3]
            assert unit == "kB"
            return int(value) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def upload(server: ServerProcess, size: int) -> int:
    """Stream ``size`` bytes of JSONL to the server; returns the stored file's size."""
    chunks, expected = jsonl_stream(size)
    content_type, body = multipart(chunks)
    with server.client() as client:
        response = client.post(
            "/v1/files", content=body, headers={"Content-Type": content_type}, timeout=120
        )
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["status"] == "processed"
    assert file["bytes"] == expected
    return int(file["bytes"])


def test_peak_memory_does_not_grow_with_upload_size(server_process: ServerProcess) -> None:
    pid = server_process.process.pid
    small = upload(server_process, SMALL)
    after_small = peak_rss(pid)
    big = upload(server_process, BIG)
    after_big = peak_rss(pid)

    assert big - small > 80 * MiB
    growth = after_big - after_small
    assert growth < ALLOWED_GROWTH, (
        f"peak RSS grew by {growth / MiB:.1f} MiB for {(big - small) / MiB:.0f} MiB more upload "
        f"(after small: {after_small / MiB:.1f} MiB, after big: {after_big / MiB:.1f} MiB)"
    )
    with server_process.client() as client:
        listed = client.get("/v1/files").json()
    assert sorted(f["bytes"] for f in listed["data"]) == [small, big]
