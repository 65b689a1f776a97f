"""``GET /v1/batches/{id}/progress``: requests done over time, read back from the times the
batch's results were stored, so a batch that ran while nobody watched still has its curve.

Time here is work (``WorkClock``): the clock moves only as the engine takes requests, so the
times the curve holds are known whatever the speed of this machine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.domain.progress import MAX_POINTS
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.integration.test_auth import READ_ONLY, error_of, other_org_key
from tests.support import (
    SIM_MODEL,
    TERMINAL,
    InProcess,
    chat_line,
    in_process_backfill,
    running_simulator,
)

PER_S = 20  # requests the engine takes per clock second
START = 1_800_000_000.0


class WorkClock:
    """A clock that advances by one second for every ``PER_S`` requests the engine takes."""

    def __init__(self, sim: Simulator) -> None:
        self._sim = sim

    def now(self) -> float:
        return START + self._sim.stats.requests / PER_S

    def monotonic(self) -> float:
        # Only the wall clock follows the work; backoffs and pauses take real time.
        return time.monotonic()


async def progress(
    bf: InProcess, batch_id: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    response = await bf.client.get(f"/v1/batches/{batch_id}/progress", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    found: dict[str, Any] = response.json()
    assert found["object"] == "batch.progress"
    assert found["batch_id"] == batch_id
    return found


def assert_a_curve(found: dict[str, Any], upto: int) -> None:
    """Results counted in the order stored, by times that never go back, up to ``upto``."""
    done = [p["done"] for p in found["points"]]
    times = [p["at"] for p in found["points"]]
    assert done == sorted(set(done)), done
    assert times == sorted(times), times
    if done:
        assert done[0] == 1
        assert done[-1] == upto
    assert len(done) <= MAX_POINTS


async def test_the_curve_holds_every_stored_result_at_the_time_it_was_stored(
    tmp_path: Path,
) -> None:
    async with running_simulator(SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4)) as (
        url,
        sim,
    ):
        engine = OpenAIHttpEngine("sim", url, {SIM_MODEL: SIM_MODEL}, max_concurrency=4)
        clock = WorkClock(sim)
        async with in_process_backfill(
            tmp_path, url, engines=[engine], clock=clock, lease_s=3600.0
        ) as bf:
            # More lines than a curve has points, a few of them failing.
            lines = [chat_line(f"ok-{i:03d}", f"question {i}") for i in range(146)]
            lines += [chat_line(f"bad-{i}", "[[sim:status=400]]") for i in range(4)]
            batch_id = (await bf.submit(lines))["id"]
            for _ in range(6000):
                found = await progress(bf, batch_id)
                # Read after the curve: it never counts more than the batch did by then.
                batch = await bf.batch(batch_id)
                counted = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
                assert found["total"] == len(lines)
                last = found["points"][-1]["done"] if found["points"] else 0
                assert last <= counted
                assert_a_curve(found, last)
                if batch["status"] in TERMINAL:
                    break
                # Leaves the worker the database between reads.
                await asyncio.sleep(0.01)
            assert batch["status"] == "completed"
            final = await progress(bf, batch_id)

            small = (await bf.submit([chat_line(f"s-{i}") for i in range(5)]))["id"]
            small_batch = await bf.wait(small)
            small_curve = await progress(bf, small)

    assert batch["request_counts"] == {"total": 150, "completed": 146, "failed": 4}
    assert len(final["points"]) == MAX_POINTS
    assert_a_curve(final, 150)
    # The times are the clock's: none before the batch ran, none after the engine's last
    # request, and the last one is the moment the last result moved the batch to finalizing.
    times = [p["at"] for p in final["points"]]
    assert times[0] >= batch["in_progress_at"]
    assert times[-1] <= START + 150 / PER_S
    assert int(times[-1]) == batch["finalizing_at"]
    # A batch shorter than a curve: every result is a point.
    assert [p["done"] for p in small_curve["points"]] == [1, 2, 3, 4, 5]
    assert int(small_curve["points"][-1]["at"]) == small_batch["finalizing_at"]


async def test_a_read_only_key_reads_it(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a"), chat_line("b")])
    reader = await backfill.backfill.services.tenants.create_key("default", READ_ONLY)
    found = await progress(backfill, batch["id"], {"Authorization": f"Bearer {reader}"})
    assert found["total"] == 2
    assert [p["done"] for p in found["points"]] == [1, 2]
    assert all(isinstance(p["at"], float) for p in found["points"])


async def test_another_orgs_batch_is_404_as_the_batch_itself_is(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a")])
    other = {"Authorization": f"Bearer {await other_org_key(backfill)}"}
    for batch_id in (batch["id"], "batch_unknown"):
        refused = await backfill.client.get(f"/v1/batches/{batch_id}/progress", headers=other)
        itself = await backfill.client.get(f"/v1/batches/{batch_id}", headers=other)
        assert error_of(refused, 404) == error_of(itself, 404)
        assert error_of(refused, 404)["param"] == "batch_id"


async def test_the_answer_has_the_documented_fields(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a")])
    found = await progress(backfill, batch["id"])
    spec = (await backfill.client.get("/openapi.json")).json()
    schema = spec["components"]["schemas"]["BatchProgress"]
    assert set(schema["required"]) == set(found)
    items = schema["properties"]["points"]["items"]
    point = spec["components"]["schemas"][items["$ref"].rsplit("/", 1)[-1]]
    assert all(set(point["required"]) == set(p) for p in found["points"])
    operation = spec["paths"]["/v1/batches/{batch_id}/progress"]["get"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchProgress"
    }
