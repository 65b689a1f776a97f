"""Cancelling and expiring batches mid-run, and validation of batch creation.

SPEC §4.1 (completion_window, metadata, unknown fields), §4.5 (cancel), §4.6 (expiry),
§6.2-6.3 (error rows ``batch_cancelled`` / ``batch_expired``, one row per ``custom_id``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from backfill.adapters.clock import ManualClock
from tests.support import (
    FAST,
    InProcess,
    assert_exactly_once,
    backfill_on,
    chat_line,
    eventually,
    in_flight,
    jsonl,
    wait_terminal,
)

# ---- cancel -------------------------------------------------------------------------------


async def test_cancel_lets_running_requests_finish_and_closes_the_rest(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=2) as (bf, sim):
        rows = [chat_line(f"fast-{i}", f"quick question {i}") for i in range(2)]
        rows += [
            chat_line(f"slow-{i:02d}", f"[[sim:delay_ms=2000]] slow question {i}")
            for i in range(18)
        ]
        created = await bf.submit(rows)
        batch_id = created["id"]

        async def two_done_two_running() -> bool:
            batch = await bf.batch(batch_id)
            return bool(batch["request_counts"]["completed"] >= 2 and sim.stats.in_flight == 2)

        await eventually(two_done_two_running, what="two finished and two running requests")

        # The SDK sends an empty JSON object as the body.
        cancel = await bf.client.post(
            f"/v1/batches/{batch_id}/cancel",
            content=b"{}",
            headers={"Content-Type": "application/json"},
        )
        running_at_cancel = sim.stats.in_flight
        started_at_cancel = sim.stats.requests
        assert cancel.status_code == 200, cancel.text
        cancelling = cancel.json()
        assert cancelling["id"] == batch_id
        assert cancelling["status"] == "cancelling"
        assert cancelling["cancelling_at"] is not None
        assert cancelling["cancelled_at"] is None
        assert cancelling["output_file_id"] is None
        assert running_at_cancel > 0, "cancel must answer at once, not after running requests"

        await eventually(
            in_flight(sim), lambda n: n == 0, what="the running requests to end", interval_s=0.02
        )
        drained = time.monotonic()
        await wait_terminal(bf.client, batch_id, timeout_s=30)
        waited = time.monotonic() - drained
        assert waited < 5, f"'cancelled' came {waited:.1f}s after the last request ended"

        batch = await bf.batch(batch_id)
        out = await bf.rows(batch["output_file_id"])
        err = await bf.rows(batch["error_file_id"])
        await asyncio.sleep(0.3)
        started_after = sim.stats.requests

    assert batch["status"] == "cancelled"
    assert batch["cancelled_at"] is not None
    assert batch["cancelling_at"] == cancelling["cancelling_at"]
    assert batch["cancelled_at"] >= batch["cancelling_at"]
    assert batch["completed_at"] is None
    assert_exactly_once(rows, out, err)
    # The requests that were running finished and are published; nothing new started.
    assert started_after == started_at_cancel, "a request started after the cancel"
    assert len(out) == started_at_cancel
    assert {"fast-0", "fast-1"} <= {r["custom_id"] for r in out}
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    assert len(err) == 20 - len(out)
    assert len(err) >= 14
    for row in err:
        assert row["response"] is None
        assert row["error"]["code"] == "batch_cancelled"
        assert row["error"]["message"]
    assert batch["request_counts"] == {"total": 20, "completed": len(out), "failed": len(err)}


async def test_cancel_of_a_terminal_batch_returns_it_unchanged(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        rows = [chat_line(f"r-{i}", f"question {i}") for i in range(3)]
        done = await bf.run_batch(rows)
        assert done["status"] == "completed"
        again_empty = await bf.client.post(f"/v1/batches/{done['id']}/cancel", json={})
        again_bare = await bf.client.post(f"/v1/batches/{done['id']}/cancel")
        after = await bf.batch(done["id"])
        missing = await bf.client.post("/v1/batches/batch_doesnotexist/cancel", json={})

    assert again_empty.status_code == 200, again_empty.text
    assert again_bare.status_code == 200, again_bare.text
    assert again_empty.json() == done
    assert again_bare.json() == done
    assert after == done
    assert missing.status_code == 404


async def test_cancel_twice_while_cancelling_is_idempotent(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=1) as (bf, sim):
        rows = [chat_line(f"s-{i}", f"[[sim:delay_ms=1500]] slow {i}") for i in range(4)]
        batch_id = (await bf.submit(rows))["id"]
        await eventually(in_flight(sim), lambda n: n == 1, what="a running request")
        first = await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
        second = await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
        assert first.status_code == second.status_code == 200
        assert first.json()["status"] == "cancelling"
        assert second.json()["status"] in ("cancelling", "cancelled")
        assert second.json()["cancelling_at"] == first.json()["cancelling_at"]
        final = await bf.wait(batch_id, timeout_s=30)
        out = await bf.rows(final["output_file_id"])
        err = await bf.rows(final["error_file_id"])

    assert final["status"] == "cancelled"
    assert_exactly_once(rows, out, err)
    assert len(out) >= 1
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}


# ---- expiry -------------------------------------------------------------------------------


async def test_expiry_publishes_finished_and_closes_the_rest(tmp_path: Path) -> None:
    clock = ManualClock()
    async with backfill_on(
        tmp_path, FAST, max_concurrency=4, clock=clock, min_completion_window_s=60
    ) as (bf, sim):
        rows = [chat_line(f"fast-{i}", f"quick question {i}") for i in range(5)]
        rows += [
            chat_line(f"slow-{i:02d}", f"[[sim:delay_ms=60000]] very slow question {i}")
            for i in range(15)
        ]
        created = await bf.submit(rows, completion_window="1m")
        batch_id = created["id"]
        assert created["completion_window"] == "1m"
        assert created["expires_at"] == created["created_at"] + 60

        async def stuck() -> bool:
            batch = await bf.batch(batch_id)
            return bool(batch["request_counts"]["completed"] == 5 and sim.stats.in_flight == 4)

        await eventually(stuck, what="five finished and four running requests")
        started_before = sim.stats.requests
        clock.advance(61)
        # The four running answers take 60 s: expiring within the wait below proves that
        # in-flight requests are abandoned, not awaited.
        await wait_terminal(bf.client, batch_id, timeout_s=30)
        batch = await bf.batch(batch_id)
        out = await bf.rows(batch["output_file_id"])
        err = await bf.rows(batch["error_file_id"])
        await asyncio.sleep(0.3)
        started_after = sim.stats.requests

    assert batch["status"] == "expired"
    assert batch["expired_at"] is not None
    assert batch["expired_at"] >= batch["expires_at"]
    assert batch["completed_at"] is None
    assert batch["cancelled_at"] is None
    assert started_after == started_before, "a request started after the window ended"
    assert_exactly_once(rows, out, err)
    assert sorted(r["custom_id"] for r in out) == [f"fast-{i}" for i in range(5)]
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert sorted(r["custom_id"] for r in err) == [f"slow-{i:02d}" for i in range(15)]
    for row in err:
        assert row["response"] is None
        assert row["error"]["code"] == "batch_expired"
        assert row["error"]["message"]
    assert batch["request_counts"] == {"total": 20, "completed": 5, "failed": 15}


async def test_expiry_before_anything_ran(tmp_path: Path) -> None:
    clock = ManualClock()
    async with backfill_on(
        tmp_path, FAST, max_concurrency=1, clock=clock, min_completion_window_s=60
    ) as (bf, sim):
        rows = [chat_line(f"s-{i}", f"[[sim:delay_ms=60000]] slow {i}") for i in range(3)]
        batch_id = (await bf.submit(rows, completion_window="60s"))["id"]
        await eventually(in_flight(sim), lambda n: n == 1, what="a running request")
        clock.advance(120)
        batch = await bf.wait(batch_id, timeout_s=30)
        out = await bf.rows(batch["output_file_id"])
        err = await bf.rows(batch["error_file_id"])

    assert batch["status"] == "expired"
    assert out == []
    assert_exactly_once(rows, out, err)
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


# ---- validation ---------------------------------------------------------------------------


async def uploaded_file(bf: InProcess) -> str:
    response = await bf.upload(jsonl([chat_line("only", "hello")]))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


def assert_invalid(response: Any, param: str, code: str = "invalid_value") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["param"] == param, error
    assert param.split(".")[0] in error["message"], error
    assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    "window",
    [
        "1h",  # below the default minimum of 24h
        "86399s",
        "169h",  # above the default maximum of 168h
        "1000h",
        "tomorrow",
        "24",
        "",
        "1.5h",
        "-24h",
        "24 hours",
        86400,
    ],
)
async def test_completion_window_out_of_range_or_garbage(backfill: InProcess, window: Any) -> None:
    file_id = await uploaded_file(backfill)
    response = await backfill.client.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
        },
    )
    assert_invalid(response, "completion_window")
    listed = (await backfill.client.get("/v1/batches")).json()
    assert listed["data"] == [], "a rejected batch must not be created"


@pytest.mark.parametrize("window", ["24h", "1440m", "168h"])
async def test_completion_window_bounds_are_inclusive(backfill: InProcess, window: str) -> None:
    file_id = await uploaded_file(backfill)
    response = await backfill.create(file_id, completion_window=window)
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["completion_window"] == window
    assert batch["expires_at"] > batch["created_at"]


async def test_lowered_minimum_window_is_honoured(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4, min_completion_window_s=60) as (
        bf,
        _,
    ):
        file_id = await uploaded_file(bf)
        below = await bf.create(file_id, completion_window="59s")
        at_min = await bf.create(file_id, completion_window="60s")
    assert_invalid(below, "completion_window")
    assert at_min.status_code == 200, at_min.text
    assert at_min.json()["expires_at"] == at_min.json()["created_at"] + 60


async def test_unknown_field_in_create_is_rejected(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    response = await backfill.create(file_id, priority="high")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority"
    assert "priority" in error["message"]
    assert response.headers["x-should-retry"] == "false"
    assert (await backfill.client.get("/v1/batches")).json()["data"] == []


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"key": "v" * 513}, "metadata"),
        ({"key": 5}, "metadata"),
        ({"key": None}, "metadata"),
        (["not", "an", "object"], "metadata"),
        ("text", "metadata"),
    ],
    ids=["17-pairs", "key-65", "value-513", "int-value", "null-value", "list", "string"],
)
async def test_metadata_limits(backfill: InProcess, metadata: Any, param: str) -> None:
    file_id = await uploaded_file(backfill)
    response = await backfill.create(file_id, metadata=metadata)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_value", error
    assert str(error["param"]).startswith(param), error
    assert "metadata" in error["message"]
    assert (await backfill.client.get("/v1/batches")).json()["data"] == []


async def test_metadata_at_the_limits_is_accepted(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    metadata = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
    full = await backfill.create(file_id, metadata=metadata)
    null = await backfill.create(file_id, metadata=None)
    assert full.status_code == 200, full.text
    assert full.json()["metadata"] == metadata
    assert null.status_code == 200, null.text
    assert null.json()["metadata"] is None
