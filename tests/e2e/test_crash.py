"""SIGKILL the server in the middle of a batch, restart it, and lose or duplicate nothing.

SPEC §9.6 (durability: restarting any process never loses or duplicates a result), §6.3.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import (
    TERMINAL,
    ServerProcess,
    SimulatorProcess,
    batch_of,
    chat_line,
    rows_of,
    simulator_process,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOTAL = 2000


@pytest.fixture
def fast_sim() -> Iterator[SimulatorProcess]:
    with simulator_process("--ttft-ms", "20", "--itl-ms", "0") as process:
        yield process


def test_sigkill_mid_batch_loses_and_duplicates_nothing(
    tmp_path: Path, fast_sim: SimulatorProcess
) -> None:
    server: ServerProcess = start_server_process(tmp_path, fast_sim.base_url, max_concurrency=8)
    try:
        rows = [chat_line(f"crash-{i:04d}", f"question number {i}") for i in range(TOTAL)]
        with server.client() as client:
            batch_id = submit(client, rows)

            deadline = time.monotonic() + 60
            done_at_kill = -1
            while time.monotonic() < deadline:
                batch = batch_of(client, batch_id)
                done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
                assert batch["status"] not in TERMINAL, (
                    f"the batch finished before the kill ({done} done); slow the engine down"
                )
                if done >= TOTAL * 0.20:
                    done_at_kill = done
                    server.kill()
                    break
                time.sleep(0.02)
            assert done_at_kill >= 0, "the batch never reached 20% within 60 s"
            assert done_at_kill <= TOTAL * 0.70, f"killed too late, at {done_at_kill}/{TOTAL}"

        server.restart()
        with server.client() as client:
            after_restart = batch_of(client, batch_id)
            counts = after_restart["request_counts"]
            assert counts["completed"] + counts["failed"] >= done_at_kill, (
                "results counted before the kill were lost"
            )
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                batch = batch_of(client, batch_id)
                if batch["status"] in TERMINAL:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"batch not finished 90 s after restart: {batch}")
            out = rows_of(client, batch["output_file_id"])
            err = rows_of(client, batch["error_file_id"])
    finally:
        server.stop()

    assert batch["status"] == "completed", batch
    seen = Counter(r["custom_id"] for r in out + err)
    duplicated = sorted(c for c, n in seen.items() if n > 1)
    assert not duplicated, f"{len(duplicated)} custom_ids twice, e.g. {duplicated[:5]}"
    assert set(seen) == {r["custom_id"] for r in rows}
    assert err == [], f"rows failed after the restart: {err[:3]}"
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert batch["request_counts"] == {"total": TOTAL, "completed": TOTAL, "failed": 0}
    # The engine saw every request at least once; the ones in flight at the kill ran again.
    assert fast_sim.stats()["requests"] >= TOTAL
