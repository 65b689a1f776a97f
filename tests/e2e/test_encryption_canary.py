"""Prompt content never reaches disk in plaintext, nor the server log (SPEC §10.2, §10.4)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import TERMINAL, ServerProcess, chat_line, jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def files_containing(root: Path, needle: bytes) -> list[str]:
    found: list[str] = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and needle in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return found


def test_canary_is_encrypted_at_rest_and_kept_out_of_logs(server_process: ServerProcess) -> None:
    canary = f"CANARY-{uuid.uuid4().hex}-SECRET"
    rows = [
        chat_line(f"row-{i}", f"Please summarise this: {canary} (part {i})", max_tokens=8)
        for i in range(20)
    ]
    # A rejected upload exercises the error path; it must not log the content either.
    bad_rows = [*rows[:2], {**chat_line("row-x", f"{canary} again"), "extra_key": canary}]

    with server_process.client() as client:
        uploaded = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
        )
        assert uploaded.status_code == 200, uploaded.text
        input_id = uploaded.json()["id"]

        # The plaintext is visible through the API, so the search below can see the canary.
        content = client.get(f"/v1/files/{input_id}/content")
        assert content.status_code == 200, content.text
        assert canary.encode() in content.content

        rejected = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("bad.jsonl", jsonl(bad_rows), "application/jsonl")},
        )
        assert rejected.status_code == 400, rejected.text

        created = client.post(
            "/v1/batches",
            json={
                "input_file_id": input_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"purpose": "canary test"},
            },
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        deadline = time.monotonic() + 90
        batch: dict[str, Any] = {}
        while time.monotonic() < deadline:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            if batch["status"] in TERMINAL:
                break
            time.sleep(0.1)
        assert batch.get("status") == "completed", batch
        assert batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            download = client.get(f"/v1/files/{file_id}/content")
            assert download.status_code == 200, download.text
        assert client.get("/v1/files").status_code == 200

    data_dir = server_process.data_dir
    names = {p.name for p in data_dir.rglob("*") if p.is_file()}
    assert any(name.endswith(".db") for name in names), f"no database under {data_dir}: {names}"
    needle = canary.encode()
    leaked = files_containing(data_dir, needle)
    assert leaked == [], f"the canary is in plaintext in {leaked} under {data_dir}"
    # The UUID alone, in case the prefix was transformed (e.g. case-folded or split).
    assert files_containing(data_dir, canary.split("-")[1].encode()) == []
    log = server_process.log.read_bytes()
    assert log, "the server log should not be empty"
    assert needle not in log, "the canary is in the server log"
    assert canary.split("-")[1].encode() not in log
