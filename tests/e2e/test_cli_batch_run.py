"""``backfill batch run``: the whole client workflow, with a retry file, resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import ServerProcess, chat_line, jsonl


def _run_cli(server: ServerProcess, *args: str) -> subprocess.Popen[str]:
    env = dict(
        os.environ, BACKFILL_API_KEY=server.key, BACKFILL_BASE_URL=server.base_url, COLUMNS="120"
    )
    return subprocess.Popen(
        [sys.executable, "-m", "backfill.cli", "batch", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_batch_run_writes_results_errors_and_retry_file(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "requests.jsonl"
    rows = [chat_line(f"ok-{i}") for i in range(20)] + [chat_line("bad", "[[sim:status=400]]")]
    source.write_bytes(jsonl(rows))
    cli = _run_cli(server_process, str(source))
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, out + err
    assert "completed" in err
    results = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"ok-{i}" for i in range(20))
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    retry = (tmp_path / "requests.jsonl.retry.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in retry] == ["bad"]


def test_interrupted_run_resumes_the_same_batch(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "slow.jsonl"
    source.write_bytes(jsonl([chat_line(f"s-{i}", "[[sim:delay_ms=1500]]") for i in range(4)]))
    state = tmp_path / "slow.jsonl.backfill.json"
    first = _run_cli(server_process, str(source))
    deadline = time.monotonic() + 60
    while not (state.exists() and "batch_id" in json.loads(state.read_text())):
        assert time.monotonic() < deadline, "the CLI never recorded its batch"
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=30)
    batch_id = json.loads(state.read_text())["batch_id"]

    second = _run_cli(server_process, str(source))
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, out + err
    assert f"Resuming batch {batch_id}" in " ".join(err.split())
    with server_process.client() as client:
        listed = client.get("/v1/batches").json()["data"]
    assert [b["id"] for b in listed] == [batch_id]
    assert (tmp_path / "slow.jsonl.retry.jsonl").read_text() == ""
