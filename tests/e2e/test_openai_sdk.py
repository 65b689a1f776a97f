"""The seed's SDK workflow and curl flow, unchanged, against a real ``backfill up``.

The SDK test uses the real local engine (llama.cpp serving SmolLM2-135M-Instruct), so real
model answers come back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ServerProcess

SEED = Path(__file__).with_name("seed_001_workflow.py.txt")
LOCAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.llama
def test_seed_sdk_workflow_gets_real_answers(llama_server: ServerProcess, tmp_path: Path) -> None:
    script = (
        SEED.read_text()
        .replace("https://api.boardwalk.cloud/v1", llama_server.base_url)
        .replace("your-api-key", llama_server.key)
        .replace("your-model-name", LOCAL_MODEL)
    )
    work = tmp_path / "client"
    work.mkdir()
    (work / "workflow.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "workflow.py"], cwd=work, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Items to review: 0" in done.stdout, done.stdout
    rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["ticket-1", "ticket-2"]
    for row in rows:
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["model"] == LOCAL_MODEL
        assert body["choices"][0]["message"]["content"].strip(), "the model said nothing"
        assert body["usage"]["completion_tokens"] > 0
    assert (work / "errors.jsonl").read_text() == ""
    assert (work / "retry.jsonl").read_text() == ""


def _curl(*args: str) -> dict[str, object]:
    done = subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    parsed: dict[str, object] = json.loads(done.stdout)
    return parsed


def test_seed_curl_flow(server_process: ServerProcess, tmp_path: Path) -> None:
    base = server_process.base_url
    auth = f"Authorization: Bearer {server_process.key}"
    source = tmp_path / "batchinput.jsonl"
    source.write_text(
        '{"custom_id": "job-1", "method": "POST", "url": "/v1/chat/completions", "body": '
        '{"model": "sim-model", "messages": [{"role": "user", "content": "Classify: great '
        'product"}], "max_tokens": 10}}\n'
        '{"custom_id": "job-2", "method": "POST", "url": "/v1/chat/completions", "body": '
        '{"model": "sim-model", "messages": [{"role": "user", "content": "Classify: broke in '
        'a day"}], "max_tokens": 10}}\n'
    )
    uploaded = _curl(f"{base}/files", "-H", auth, "-F", "purpose=batch", "-F", f"file=@{source}")
    assert uploaded["status"] == "processed"
    created = _curl(
        f"{base}/batches",
        "-H",
        auth,
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(
            {
                "input_file_id": uploaded["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
        ),
    )
    assert created["status"] in ("validating", "in_progress")
    batch = created
    for _ in range(300):
        batch = _curl(f"{base}/batches/{created['id']}", "-H", auth)
        if batch["status"] == "completed":
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert batch["status"] == "completed"
    done = subprocess.run(
        ["curl", "-sS", f"{base}/files/{batch['output_file_id']}/content", "-H", auth],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ids = sorted(json.loads(line)["custom_id"] for line in done.stdout.splitlines())
    assert ids == ["job-1", "job-2"]
