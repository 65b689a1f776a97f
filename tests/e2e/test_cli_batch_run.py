"""``backfill batch run``: the whole client workflow, with a retry file, resumable."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import ServerProcess, batch_cli, chat_line, jsonl


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


def _cli(server: ServerProcess, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return batch_cli(server, *args, columns=100, env=env)


def test_a_saved_batch_this_server_does_not_know_is_named_with_what_to_do(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "input.jsonl"
    source.write_bytes(jsonl([chat_line("a")]))
    state = tmp_path / "input.jsonl.backfill.json"
    # As a run against another server (or a batch since deleted) leaves it.
    saved = {"sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "model": None}
    state.write_text(json.dumps(saved | {"batch_id": "batch_elsewhere", "idempotency_key": "k"}))
    ran = _cli(server_process, "run", str(source))
    assert ran.returncode != 0
    said = " ".join(ran.stderr.split())
    assert "Batch batch_elsewhere" in said, said
    assert "is not on" in said, said
    assert f"Remove {state} to submit the file again" in said, said


def test_run_shows_speed_and_the_read_commands_print_ids_whole_and_json(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "staggered.jsonl"
    # Lines that end one after another, so the batch is seen running between polls.
    source.write_bytes(
        jsonl([chat_line(f"s-{i}", f"[[sim:delay_ms={400 * i}]]") for i in range(1, 9)])
    )
    # A terminal as far as rich can tell, so the progress line is drawn while it changes.
    run = _cli(server_process, "run", str(source), TTY_COMPATIBLE="1", TTY_INTERACTIVE="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tok/s" in run.stderr
    assert "ETA" in run.stderr
    batch_id = json.loads((tmp_path / "staggered.jsonl.backfill.json").read_text())["batch_id"]

    with server_process.client() as client:
        listed = client.get("/v1/batches").json()
        batch = client.get(f"/v1/batches/{batch_id}").json()

    table = _cli(server_process, "list")
    assert table.returncode == 0, table.stdout + table.stderr
    assert batch_id in table.stdout
    assert "…" not in table.stdout
    assert "8/8" in table.stdout

    as_json = _cli(server_process, "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == listed

    shown = _cli(server_process, "status", batch_id)
    assert shown.returncode == 0, shown.stderr
    assert batch_id in shown.stdout
    assert "completed" in shown.stdout

    status_json = _cli(server_process, "status", batch_id, "--json")
    assert status_json.returncode == 0, status_json.stderr
    assert json.loads(status_json.stdout) == batch


def test_the_cli_reads_the_openai_sdk_variables(server_process: ServerProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env |= {"OPENAI_BASE_URL": server_process.base_url, "OPENAI_API_KEY": server_process.key}
    listed = subprocess.run(
        [sys.executable, "-m", "backfill.cli", "batch", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert json.loads(listed.stdout)["object"] == "list"
