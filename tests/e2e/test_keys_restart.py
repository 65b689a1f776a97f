"""A real ``backfill up`` refuses, in one line, to start over data it cannot read; and what it
writes is private to its user whatever the umask."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    batch_of,
    chat_line,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def start_up(server: ServerProcess) -> subprocess.CompletedProcess[str]:
    """``backfill up`` on the server's data directory, expected to exit by itself."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "backfill.cli",
            "up",
            "--port",
            str(server.port),
            "--data",
            str(server.data_dir),
            "--no-local-engine",
            "--config",
            str(server.config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_refusal(run: subprocess.CompletedProcess[str], says: str) -> None:
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, run.stderr
    assert says in errors[0]


def test_a_deleted_key_file_is_not_replaced(server_process: ServerProcess) -> None:
    with server_process.client() as client:
        submit(client, [chat_line("a")])
    server_process.stop()
    key_file = server_process.data_dir / "master.key"
    key_file.unlink()
    run = start_up(server_process)
    assert_one_line_refusal(run, "is missing, but the database already holds")
    assert not key_file.exists()


@pytest.mark.parametrize(
    "content",
    [b"garbage!\n", base64.b64encode(os.urandom(16)) + b"\n", base64.b64encode(os.urandom(32))],
    ids=["garbage", "short", "another key"],
)
def test_an_unusable_or_other_key_file_is_refused(
    server_process: ServerProcess, content: bytes
) -> None:
    server_process.stop()
    (server_process.data_dir / "master.key").write_bytes(content)
    run = start_up(server_process)
    assert_one_line_refusal(run, "master")


def test_data_files_are_private_whatever_the_umask(
    tmp_path: Path, sim_process: SimulatorProcess
) -> None:
    previous = os.umask(0)
    try:
        server = start_server_process(tmp_path, sim_process.base_url)
    finally:
        os.umask(previous)
    try:
        with server.client() as client:
            batch_id = submit(client, [chat_line(f"m-{i}") for i in range(5)])
            for _ in range(200):
                if batch_of(client, batch_id)["status"] == "completed":
                    break
                time.sleep(0.05)
            assert batch_of(client, batch_id)["status"] == "completed"
        data = server.data_dir
        files = [data / "backfill.db", data / "backfill.db-wal", data / "backfill.db-shm"]
        files += [p for p in (data / "blobs").rglob("*") if p.is_file()]
        dirs = [data, data / "blobs", data / "blobs" / "files", data / "blobs" / ".tmp"]
        assert len(files) > 5
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        for path in dirs:
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    finally:
        server.stop()
