"""``backfill batch run`` writes rows while the batch runs; SIGKILLs lose and repeat nothing.

The CLI is killed twice mid-batch (the server once too, between its runs), with a torn row
left at the end of the results file as a kill during a write leaves one. The rerun cuts the
files back to what its saved cursor covers and reads on: in the end both files hold exactly
the rows of the batch's output and error files. SPEC §4.8, §6.3, §11.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    TERMINAL,
    ServerProcess,
    SimulatorProcess,
    batch_of,
    chat_line,
    jsonl,
    simulator_process,
    start_server_process,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LINES = 240
BAD = 6


def _run_cli(server: ServerProcess, source: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ, BACKFILL_API_KEY=server.key, BACKFILL_BASE_URL=server.base_url, COLUMNS="120"
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "backfill.cli", "batch", "run", str(source)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _saved(state: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(state.read_text())
    except (OSError, ValueError):
        return {}
    return data


def _kill_after_rows(
    cli: subprocess.Popen[bytes], server: ServerProcess, state: Path, more_than: int
) -> int:
    """SIGKILL the CLI once it has saved more than ``more_than`` rows of a running batch."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert cli.poll() is None, "the CLI ended before it was killed"
        saved = _saved(state)
        rows = int(saved.get("results", {}).get("rows", 0))
        if rows > more_than:
            with server.client() as client:
                status = batch_of(client, saved["batch_id"])["status"]
            assert status not in TERMINAL, "the batch ended before the kill; slow it down"
            cli.send_signal(signal.SIGKILL)
            cli.wait()
            return rows
        time.sleep(0.05)
    raise AssertionError("the CLI never saved rows of the running batch")


@pytest.fixture
def slow_sim() -> Iterator[SimulatorProcess]:
    with simulator_process("--ttft-ms", "150", "--itl-ms", "0") as process:
        yield process


def test_killed_runs_resume_and_write_every_row_exactly_once(
    tmp_path: Path, slow_sim: SimulatorProcess
) -> None:
    server = start_server_process(tmp_path, slow_sim.base_url, max_concurrency=4)
    try:
        source = tmp_path / "requests.jsonl"
        lines = [chat_line(f"ok-{i:03d}", f"question {i}") for i in range(LINES)]
        lines += [chat_line(f"bad-{i}", "[[sim:status=400]]") for i in range(BAD)]
        source.write_bytes(jsonl(lines))
        state = tmp_path / "requests.jsonl.backfill.json"
        results, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
        log = tmp_path / "cli.log"

        first = _kill_after_rows(_run_cli(server, source, log), server, state, 0)
        # A kill in the middle of a write leaves a torn row past the saved length.
        with results.open("ab") as torn:
            torn.write(b'{"id":"batch_req_torn","custom_id":"ok-0')
        server.kill()
        server.restart()

        _kill_after_rows(_run_cli(server, source, log), server, state, first)

        last = _run_cli(server, source, log)
        assert last.wait(timeout=180) == 0, log.read_text()
        assert "Resuming batch" in " ".join(log.read_text().split())

        saved = _saved(state)
        batch_id = saved["batch_id"]
        # The rows came page by page (the published files were not downloaded instead).
        assert saved["results"]["complete"] is True
        assert saved["results"]["rows"] == LINES + BAD
        with server.client() as client:
            batch = batch_of(client, batch_id)
            assert batch["status"] == "completed"
            final = {
                kind: client.get(f"/v1/files/{batch[kind]}/content").content.splitlines()
                for kind in ("output_file_id", "error_file_id")
            }
            listed = client.get("/v1/batches").json()["data"]
        assert [b["id"] for b in listed] == [batch_id], "a rerun must not submit again"
    finally:
        server.stop()

    written = {"output_file_id": results, "error_file_id": errors}
    for kind, path in written.items():
        rows = path.read_bytes().splitlines()
        assert sorted(rows) == sorted(final[kind]), f"{path.name} differs from the {kind} file"
    every = [json.loads(r) for path in written.values() for r in path.read_bytes().splitlines()]
    counts = Counter(row["custom_id"] for row in every)
    assert [c for c, n in counts.items() if n > 1] == []
    assert set(counts) == {line["custom_id"] for line in lines}
    retry = (tmp_path / "requests.jsonl.retry.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in retry) == [f"bad-{i}" for i in range(BAD)]
