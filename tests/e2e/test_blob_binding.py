"""Blobs are bound to their file over real HTTP: a blob copied over another tenant's blob is
refused, and ``backfill db reencrypt`` converts blobs of the old, unbound format."""

from __future__ import annotations

import base64
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ServerProcess, chat_line, jsonl, legacy_blob

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CANARY = "ORG-A-SECRET-CANARY-991"


def cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backfill.cli", *args, "--config", str(server.config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, BACKFILL_DATA_DIR=str(server.data_dir)),
    )


def upload(client: httpx.Client, content: bytes) -> str:
    response = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", content, "application/jsonl")},
    )
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


def blob(server: ServerProcess, file_id: str) -> Path:
    return server.data_dir / "blobs" / "files" / file_id


def test_a_blob_copied_over_another_orgs_blob_is_refused(server_process: ServerProcess) -> None:
    server = server_process
    assert cli(server, "admin", "org", "create", "org-b").returncode == 0
    made = cli(server, "admin", "key", "create", "--org", "org-b")
    assert made.returncode == 0, made.stderr
    key_b = made.stdout.strip().splitlines()[-1]
    with server.client() as client_a:
        file_a = upload(client_a, jsonl([chat_line(f"secretA-{i}", CANARY) for i in range(9)]))
    with httpx.Client(
        base_url=f"http://127.0.0.1:{server.port}",
        headers={"Authorization": f"Bearer {key_b}"},
        timeout=30,
    ) as client_b:
        file_b = upload(client_b, jsonl([chat_line("mine", "org b's own prompt")]))
        blob(server, file_b).write_bytes(blob(server, file_a).read_bytes())
        for headers in ({}, {"Range": "bytes=0-99"}):
            response = client_b.get(f"/v1/files/{file_b}/content", headers=headers)
            assert CANARY.encode() not in response.content
            assert response.status_code == 500, response.text
            assert response.headers["x-should-retry"] == "false"
            assert response.json()["error"]["code"] == "content_unreadable"


def write_legacy(path: Path, master: bytes, data: bytes) -> None:
    """``data`` in format 1 ("BFE1"), as releases before the binding wrote it."""
    path.write_bytes(legacy_blob(master, data))


def floor(server: ServerProcess) -> int:
    with sqlite3.connect(server.data_dir / "backfill.db") as db:
        (value,) = db.execute("SELECT min_blob_format FROM keyring").fetchone()
    return int(value)


def test_reencrypt_converts_old_blobs_and_then_refuses_the_old_format(
    server_process: ServerProcess,
) -> None:
    server = server_process
    content = jsonl([chat_line(f"r-{i}", f"question {i}") for i in range(30)])
    with server.client() as client:
        file_ids = [upload(client, content) for _ in range(3)]
    server.stop()
    # Turn the data directory into one from before blobs were bound to their file.
    master = base64.b64decode((server.data_dir / "master.key").read_bytes())
    for file_id in file_ids:
        write_legacy(blob(server, file_id), master, content)
    with sqlite3.connect(server.data_dir / "backfill.db") as db:
        db.execute("UPDATE keyring SET min_blob_format = 1")

    server.restart()
    with server.client() as client:
        assert client.get(f"/v1/files/{file_ids[0]}/content").content == content
    server.stop()

    converted = cli(server, "db", "reencrypt")
    assert converted.returncode == 0, converted.stderr
    assert "Re-encrypted 3 blobs of 3 files" in converted.stdout
    assert floor(server) == 2
    assert all(blob(server, f).read_bytes()[:4] == b"BFE2" for f in file_ids)

    write_legacy(blob(server, file_ids[1]), master, content)
    server.restart()
    with server.client() as client:
        for file_id in (file_ids[0], file_ids[2]):
            assert client.get(f"/v1/files/{file_id}/content").content == content
        refused = client.get(f"/v1/files/{file_ids[1]}/content")
        assert refused.status_code == 500
        assert refused.json()["error"]["code"] == "content_unreadable"
