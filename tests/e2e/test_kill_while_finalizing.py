"""SIGKILL ``backfill up`` while a batch is ``finalizing``: after the restart the batch
completes within seconds, with every row exactly once. Before, the dead attempt's finalize
lease (a fixed 120 s) held the batch there for about two minutes, its credit reserved and its
webhook waiting (the 2026-12-05 review, L1)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    assert_exactly_once,
    batch_of,
    chat_line,
    rows_of,
    simulator_process,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LINES = 4000
# The restarted worker's lease (``lease_s`` of the test config) is 5 s; the old fixed finalize
# lease was 120 s. Well between the two.
AFTER_RESTART_S = 30


@pytest.fixture
def wordy_sim() -> Iterator[SimulatorProcess]:
    """Fast answers with long texts, so a finalize has megabytes to write and lasts long
    enough to be caught."""
    with simulator_process("--ttft-ms", "1", "--itl-ms", "0", "--output-tokens", "600") as process:
        yield process


def kill_while_finalizing(
    server: ServerProcess, tries: int = 3
) -> tuple[str, list[dict[str, object]]]:
    """Submit batches until one is seen ``finalizing``, and SIGKILL the server then."""
    with server.client() as client:
        for attempt in range(tries):
            rows = [chat_line(f"f{attempt}-{i:05d}", f"question {i}") for i in range(LINES)]
            batch_id = submit(client, rows)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status = batch_of(client, batch_id)["status"]
                if status == "finalizing":
                    server.kill()
                    return batch_id, rows
                if status == "completed":
                    break
                time.sleep(0.005)
    raise AssertionError(f"no batch was seen finalizing in {tries} tries")


def test_a_kill_while_finalizing_delays_the_batch_by_seconds_not_minutes(
    tmp_path: Path, wordy_sim: SimulatorProcess
) -> None:
    server = start_server_process(tmp_path, wordy_sim.base_url, max_concurrency=16)
    try:
        batch_id, rows = kill_while_finalizing(server)
        server.restart()
        restarted = time.monotonic()
        with server.client() as client:
            while (batch := batch_of(client, batch_id))["status"] != "completed":
                waited = time.monotonic() - restarted
                assert waited < AFTER_RESTART_S, f"still {batch['status']} after {waited:.0f} s"
                time.sleep(0.1)
            out = rows_of(client, batch["output_file_id"])
            err = rows_of(client, batch["error_file_id"])
        assert_exactly_once(rows, out, err)
        assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    finally:
        server.stop()
