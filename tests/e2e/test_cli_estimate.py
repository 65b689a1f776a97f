"""``backfill batch estimate``: uploads a file (or takes one uploaded before) and prints what a
batch of it would cost and decide, against a real ``backfill up``; nothing is created."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support import ServerProcess, batch_cli, chat_line, jsonl, until


def _cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return batch_cli(server, "estimate", *args, columns=100)


def _said(done: subprocess.CompletedProcess[str]) -> str:
    """What the command printed, its lines joined as a person reads them past the wrapping."""
    return " ".join((done.stdout + done.stderr).split())


def _rows(n: int, tokens: int = 5) -> list[dict[str, Any]]:
    # Answers of ``tokens`` tokens each, from lines that allow 64.
    return [
        chat_line(f"q{i}", f"[[sim:tokens={tokens}]] question {i}", max_tokens=64) for i in range(n)
    ]


def test_estimate_uploads_prints_and_agrees_with_the_api_and_the_creation(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl(_rows(6)))

    as_json = _cli(server_process, str(source), "--json")
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    printed = json.loads(as_json.stdout)
    file_id = printed["input_file_id"]
    assert printed["request_count"] == 6
    assert printed["admission"]["admitted"] is True
    assert printed["expected"]["basis"] == "max_tokens"
    with server_process.client() as client:
        # Nothing was created; the API answers the same for the uploaded file.
        assert client.get("/v1/batches").json()["data"] == []
        same = client.post(
            "/v1/batches/estimate",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()
    # The same answer, but for the deadline: each counts its window from its own moment.
    assert 0 <= same.pop("expires_at") - printed.pop("expires_at") <= 5
    assert same == printed

    table = _cli(server_process, "--file-id", file_id)
    assert table.returncode == 0, table.stdout + table.stderr
    said = _said(table)
    assert file_id in table.stdout  # whole, on one line
    assert f"{printed['worst_case']['cost']} USD, reserved at creation" in said
    assert "no answer of this model measured yet" in said
    available = printed["admission"]["available_credit"]
    assert f"would be accepted now ({available} USD available)" in said, said
    assert "Nothing was created" in said

    with server_process.client() as client:
        created = client.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["cost"]["reserved"] == printed["worst_case"]["cost"]
        until(
            "the batch to complete",
            lambda: client.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed",
            timeout_s=60,
        )

    # Its answers are measured now: five tokens each.
    again = tmp_path / "more.jsonl"
    again.write_bytes(jsonl(_rows(3)))
    measured = _cli(server_process, str(again))
    assert measured.returncode == 0, measured.stdout + measured.stderr
    said = _said(measured)
    assert "5 output tokens per request, measured over your last 6 answers" in said, said
    assert "15 output tokens" in said, said


def test_estimate_takes_a_file_or_a_file_id_and_names_a_refusal(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl(_rows(1)))
    both = _cli(server_process, str(source), "--file-id", "file-abc")
    assert both.returncode == 1
    assert "Give either FILE" in _said(both)
    neither = _cli(server_process)
    assert neither.returncode == 1
    assert "Give either FILE" in _said(neither)

    # A window out of the server's range: the API's own message, as creation would say it.
    short = _cli(server_process, str(source), "--window", "1h")
    assert short.returncode == 1
    said = _said(short)
    assert "POST /batches/estimate failed (400)" in said, said
    assert "'completion_window' must be from" in said, said
