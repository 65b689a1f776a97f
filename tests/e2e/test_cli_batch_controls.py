"""``backfill batch pause``, ``resume`` and ``priority`` against a real ``backfill up``."""

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
    start_server_process,
    submit,
)


@pytest.fixture
def server(tmp_path: Path, sim_process: SimulatorProcess) -> Iterator[ServerProcess]:
    process = start_server_process(tmp_path, sim_process.base_url)
    try:
        yield process
    finally:
        process.stop()


def test_a_batch_is_paused_given_a_priority_and_resumed_from_the_cli(
    server: ServerProcess,
) -> None:
    rows = [chat_line(f"c{i}", f"[[sim:delay_ms=1500]] cli {i}") for i in range(60)]
    with server.client() as client:
        batch_id = submit(client, rows)

        paused = batch_cli(server, "pause", batch_id)
        assert paused.returncode == 0, paused.stdout + paused.stderr
        assert f"backfill batch resume {batch_id}" in paused.stdout
        assert batch_of(client, batch_id)["paused_at"] is not None

        status = batch_cli(server, "status", batch_id)
        assert "paused since" in status.stdout
        assert "still reserved" in status.stdout

        raised = batch_cli(server, "priority", batch_id, "4")
        assert raised.returncode == 0, raised.stdout + raised.stderr
        assert raised.stdout.strip() == f"{batch_id}: priority 4"
        assert "priority" in batch_cli(server, "status", batch_id).stdout

        # Above the org's cap: the server's words, exit status 1.
        refused = batch_cli(server, "priority", batch_id, "50")
        assert refused.returncode == 1
        assert "at most 10" in " ".join(refused.stderr.split())

        resumed = batch_cli(server, "resume", batch_id)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        batch = ended(client, batch_id)
        assert batch["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        assert batch["priority"] == 4

        # Once over, it cannot be paused: the server says why.
        late = batch_cli(server, "pause", batch_id)
        assert late.returncode == 1
        assert "only a validating or in-progress batch" in " ".join(late.stderr.split())
