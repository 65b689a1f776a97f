"""``backfill batch retry`` and ``backfill batch delete`` against a real ``backfill up``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    batch_cli,
    batch_of,
    chat_line,
    ended,
    rows_of,
    start_server_process,
    submit,
)


@pytest.fixture
def server(tmp_path: Path, sim_process: SimulatorProcess) -> Iterator[ServerProcess]:
    """``backfill up`` whose lines get one attempt, so a line can fail once and then pass."""
    process = start_server_process(tmp_path, sim_process.base_url, extra="max_attempts = 1")
    try:
        yield process
    finally:
        process.stop()


def test_batch_retry_reruns_the_failed_lines_and_waits(server: ServerProcess) -> None:
    rows = [chat_line("ok"), chat_line("flaky", "[[sim:fail_first=1]] a flaky cli question")]
    with server.client() as client:
        batch_id = submit(client, rows)
        first = ended(client, batch_id)
        assert first["request_counts"] == {"total": 2, "completed": 1, "failed": 1}

        rerun = batch_cli(server, "retry", batch_id, "--wait")
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        new_id = rerun.stdout.strip()
        assert new_id.startswith("batch_")
        assert new_id != batch_id
        assert "completed" in rerun.stderr
        batch = batch_of(client, new_id)
        assert batch["retry_of"] == batch_id
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        assert [r["custom_id"] for r in rows_of(client, batch["output_file_id"])] == ["flaky"]

        # The rerun itself has nothing left to rerun: the server's reason, exit status 1.
        nothing = batch_cli(server, "retry", new_id)
        assert nothing.returncode == 1
        assert "nothing to rerun" in " ".join(nothing.stderr.split())

        deleted = batch_cli(server, "delete", batch_id)
        assert deleted.returncode == 0, deleted.stdout + deleted.stderr
        assert deleted.stdout.strip() == f"{batch_id}: deleted"
        assert client.get(f"/v1/batches/{batch_id}").status_code == 404
        assert client.get(f"/v1/files/{first['output_file_id']}").status_code == 404
