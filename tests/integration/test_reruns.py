"""Rerunning an ended batch's failed lines and deleting an ended batch (SPEC §4.8), through the
HTTP API of an in-process Backfill with the simulated engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from sqlalchemy import func, select

from backfill.adapters.clock import ManualClock
from backfill.adapters.db import tables
from backfill.domain.lifecycle import BatchStatus
from backfill.services.retention import Janitor
from tests.support import FAST, InProcess, backfill_on, chat_line, eventually, in_flight, jsonl

# The first attempt of these lines fails (503, and one attempt is all a line gets here); a
# rerun's attempt succeeds.
FLAKY = "[[sim:fail_first=1]]"


def flaky(custom_id: str) -> dict[str, Any]:
    return chat_line(custom_id, f"{FLAKY} flaky question {custom_id}")


def lines_of(rows: list[dict[str, Any]], custom_ids: set[str]) -> bytes:
    """The input lines of ``custom_ids``, byte for byte, in their order in ``rows``."""
    return jsonl([r for r in rows if r["custom_id"] in custom_ids])


def assert_refused(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"]
    assert response.headers["x-should-retry"] == "false"
    return error


async def retry(bf: InProcess, batch_id: str, **headers: str) -> httpx.Response:
    return await bf.client.post(f"/v1/batches/{batch_id}/retry", json={}, headers=headers)


def blob_names(bf: InProcess) -> set[str]:
    root = bf.settings.data_dir / "blobs" / "files"
    return {p.name for p in root.iterdir()} if root.exists() else set()


async def input_files(bf: InProcess) -> set[str]:
    listed = (await bf.client.get("/v1/files", params={"purpose": "batch"})).json()["data"]
    return {f["id"] for f in listed}


async def count_rows(bf: InProcess, table: Any, batch_id: str) -> int:
    async with bf.backfill.store.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.batch_id == batch_id)
        return int((await conn.execute(query)).scalar_one())


# ---- rerun --------------------------------------------------------------------------------


async def test_rerun_of_failed_and_cancelled_lines_reruns_exactly_those(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=2, max_attempts=1) as (bf, sim):
        rows = [flaky("flaky-0"), flaky("flaky-1"), chat_line("ok-0"), chat_line("ok-1")]
        rows += [chat_line(f"slow-{i}", f"[[sim:delay_ms=1500]] slow {i}") for i in range(6)]
        original = await bf.submit(rows, metadata={"team": "evals"})
        batch_id = original["id"]

        async def four_done_two_running() -> bool:
            batch = await bf.batch(batch_id)
            counts = batch["request_counts"]
            return bool(counts["completed"] + counts["failed"] >= 4 and sim.stats.in_flight == 2)

        await eventually(four_done_two_running, what="four lines done and two running")
        cancel = await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
        assert cancel.status_code == 200, cancel.text
        ended = await bf.wait(batch_id, timeout_s=30)
        errors = await bf.rows(ended["error_file_id"])

        rerun = await retry(bf, batch_id)
        assert rerun.status_code == 200, rerun.text
        created = rerun.json()
        rerun_input = await bf.client.get(f"/v1/files/{created['input_file_id']}/content")
        done = await bf.wait(created["id"], timeout_s=30)
        out = await bf.rows(done["output_file_id"])
        again_errors = await bf.rows(done["error_file_id"])
        listed = (await bf.client.get("/v1/batches")).json()["data"]

    assert ended["status"] == "cancelled"
    codes = {r["custom_id"]: (r["error"] or {}).get("code") for r in errors}
    failed = set(codes)
    # Both kinds are there: lines that failed, and lines the cancel never ran.
    assert {"flaky-0", "flaky-1"} <= failed
    assert {code for cid, code in codes.items() if cid.startswith("slow")} == {"batch_cancelled"}
    assert not failed & {"ok-0", "ok-1"}

    assert created["object"] == "batch"
    assert created["id"] != batch_id
    assert created["retry_of"] == batch_id
    assert created["input_file_id"] != original["input_file_id"]
    assert created["request_counts"]["total"] == len(failed)
    assert created["completion_window"] == original["completion_window"]
    assert created["metadata"] == {"team": "evals"}
    assert created["endpoint"] == original["endpoint"]
    # The rerun's input is the failed lines' requests as they were uploaded.
    assert rerun_input.status_code == 200, rerun_input.text
    assert rerun_input.content == lines_of(rows, failed)

    assert done["status"] == "completed"
    assert {r["custom_id"] for r in out} == failed
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert again_errors == []
    assert done["request_counts"] == {"total": len(failed), "completed": len(failed), "failed": 0}
    assert [b["id"] for b in listed] == [created["id"], batch_id]
    assert next(b for b in listed if b["id"] == batch_id)["retry_of"] is None


async def test_a_retry_body_overrides_what_the_batch_had(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        rows = [chat_line("ok"), chat_line("bad", "[[sim:status=400]]")]
        original = await bf.submit(rows, metadata={"team": "evals"})
        await bf.wait(original["id"])
        changed = await bf.client.post(
            f"/v1/batches/{original['id']}/retry",
            json={
                "completion_window": "48h",
                "metadata": None,
                "output_expires_after": {"anchor": "created_at", "seconds": 7200},
            },
        )
        unknown = await bf.client.post(
            f"/v1/batches/{original['id']}/retry", json={"input_file_id": "file-x"}
        )
        bad_window = await bf.client.post(
            f"/v1/batches/{original['id']}/retry", json={"completion_window": "1h"}
        )
        bad_metadata = await bf.client.post(
            f"/v1/batches/{original['id']}/retry", json={"metadata": {"k": 5}}
        )
        not_json = await bf.client.post(
            f"/v1/batches/{original['id']}/retry",
            content=b"[1]",
            headers={"Content-Type": "application/json"},
        )
        bare = await bf.client.post(f"/v1/batches/{original['id']}/retry")
        done = await bf.wait(changed.json()["id"])
        error_file = await bf.client.get(f"/v1/files/{done['error_file_id']}")

    assert changed.status_code == 200, changed.text
    assert changed.json()["completion_window"] == "48h"
    assert changed.json()["metadata"] is None
    assert changed.json()["request_counts"]["total"] == 1
    file = error_file.json()
    assert file["expires_at"] == file["created_at"] + 7200
    error = assert_refused(unknown, 400, "unknown_parameter")
    assert error["param"] == "input_file_id"
    assert "completion_window" in error["message"]
    assert assert_refused(bad_window, 400, "invalid_value")["param"] == "completion_window"
    assert assert_refused(bad_metadata, 400, "invalid_value")["param"].startswith("metadata")
    assert_refused(not_json, 400, "invalid_json")
    # No body at all is an empty one: everything as the batch had it.
    assert bare.status_code == 200, bare.text
    assert bare.json()["metadata"] == {"team": "evals"}


async def test_retry_honours_the_idempotency_key(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        rows = [chat_line("ok"), chat_line("bad", "[[sim:status=400]]")]
        original = await bf.submit(rows)
        await bf.wait(original["id"])
        inputs_before = await input_files(bf)
        first = await retry(bf, original["id"], **{"Idempotency-Key": "rerun-1"})
        second = await retry(bf, original["id"], **{"Idempotency-Key": "rerun-1"})
        inputs_after = await input_files(bf)
        other_body = await bf.client.post(
            f"/v1/batches/{original['id']}/retry",
            json={"completion_window": "48h"},
            headers={"Idempotency-Key": "rerun-1"},
        )
        fresh = (await bf.upload(jsonl([chat_line("fresh")]))).json()["id"]
        created_key = await bf.client.post(
            "/v1/batches",
            json={"input_file_id": fresh, "endpoint": "/v1/chat/completions"},
            headers={"Idempotency-Key": "create-1"},
        )
        reused = await retry(bf, original["id"], **{"Idempotency-Key": "create-1"})
        too_long = await retry(bf, original["id"], **{"Idempotency-Key": "k" * 257})
        listed = (await bf.client.get("/v1/batches")).json()["data"]

    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert second.json()["id"] == first.json()["id"]
    # The replay uploaded nothing: one rerun input, made by the first call.
    assert inputs_after - inputs_before == {first.json()["input_file_id"]}
    assert_refused(other_body, 409, "idempotency_key_reused")
    assert created_key.status_code == 200, created_key.text
    assert_refused(reused, 409, "idempotency_key_reused")
    assert assert_refused(too_long, 400, "invalid_value")["param"] == "Idempotency-Key"
    assert [b["id"] for b in listed] == [
        created_key.json()["id"],
        first.json()["id"],
        original["id"],
    ]


async def test_retry_refuses_what_cannot_be_rerun(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, sim):
        all_ok = await bf.run_batch([chat_line("a"), chat_line("b")])
        nothing = await retry(bf, all_ok["id"])
        with_errors = await bf.run_batch([chat_line("a"), chat_line("bad", "[[sim:status=400]]")])
        deleted = await bf.client.delete(f"/v1/files/{with_errors['error_file_id']}")
        gone = await retry(bf, with_errors["id"])
        running = await bf.submit([chat_line("s", "[[sim:delay_ms=3000]] slow")])
        await eventually(in_flight(sim), lambda n: n == 1, what="the slow line to run")
        not_ended = await retry(bf, running["id"])
        missing = await retry(bf, "batch_doesnotexist")
        listed = (await bf.client.get("/v1/batches")).json()["data"]

    error = assert_refused(nothing, 409, "nothing_to_rerun")
    assert all_ok["id"] in error["message"]
    assert deleted.status_code == 200, deleted.text
    error = assert_refused(gone, 409, "rerun_input_unavailable")
    assert with_errors["error_file_id"] in error["message"]
    error = assert_refused(not_ended, 409, "batch_not_finished")
    assert "cancel" in error["message"]
    assert_refused(missing, 404, "not_found")
    assert len(listed) == 3, "a refused retry must not create a batch"


async def test_rerun_after_the_original_input_was_removed(tmp_path: Path) -> None:
    clock = ManualClock()
    async with backfill_on(
        tmp_path, FAST, max_concurrency=4, max_attempts=1, clock=clock, janitor_interval_s=10**9
    ) as (bf, _):
        janitor = Janitor(bf.backfill.store, bf.backfill.services.files, clock)
        rows = [chat_line("ok"), flaky("flaky-a"), flaky("flaky-b")]
        original = await bf.run_batch(rows)
        # Accepted input goes once its batch ends (SPEC §10.3).
        clock.advance(1)
        assert await janitor.sweep() >= 1
        input_gone = await bf.client.get(f"/v1/files/{original['input_file_id']}")
        rerun = await retry(bf, original["id"])
        done = await bf.wait(rerun.json()["id"])
        out = await bf.rows(done["output_file_id"])

    assert input_gone.status_code == 404
    assert rerun.status_code == 200, rerun.text
    assert done["status"] == "completed"
    assert sorted(r["custom_id"] for r in out) == ["flaky-a", "flaky-b"]


async def test_the_rerun_input_expires_with_the_error_file(tmp_path: Path) -> None:
    clock = ManualClock()
    async with backfill_on(
        tmp_path, FAST, max_concurrency=4, clock=clock, janitor_interval_s=10**9
    ) as (bf, _):
        janitor = Janitor(bf.backfill.store, bf.backfill.services.files, clock)
        batch = await bf.run_batch([chat_line("ok"), chat_line("bad", "[[sim:status=400]]")])
        rerun_blob = f"{batch['error_file_id']}.rerun"
        kept = rerun_blob in blob_names(bf)
        error_file = (await bf.client.get(f"/v1/files/{batch['error_file_id']}")).json()
        clock.advance(error_file["expires_at"] - clock.now() + 1)
        await janitor.sweep()
        removed = rerun_blob not in blob_names(bf)
        refused = await retry(bf, batch["id"])

    assert kept
    assert removed
    error = assert_refused(refused, 409, "rerun_input_unavailable")
    assert batch["error_file_id"] in error["message"]


async def test_a_failed_batch_reruns_all_its_lines_from_its_input(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        rows = [chat_line(f"r-{i}", f"[[sim:delay_ms=500]] question {i}") for i in range(3)]
        original = await bf.submit(rows)
        store = bf.backfill.store
        reason = {"code": "input_unavailable", "message": "gone", "param": None, "line": None}
        assert await store.fail_batch(original["id"], BatchStatus.IN_PROGRESS, 1, [reason])
        rerun = await retry(bf, original["id"])
        done = await bf.wait(rerun.json()["id"])
        out = await bf.rows(done["output_file_id"])
        # Once its input is gone, a failed batch has nothing to rerun from. The rerun's end
        # already let the input go (SPEC §10.3); deleting it makes sure.
        removed = await bf.client.delete(f"/v1/files/{original['input_file_id']}")
        refused = await retry(bf, original["id"])

    assert rerun.status_code == 200, rerun.text
    assert rerun.json()["input_file_id"] == original["input_file_id"]
    assert rerun.json()["retry_of"] == original["id"]
    assert done["status"] == "completed"
    assert sorted(r["custom_id"] for r in out) == ["r-0", "r-1", "r-2"]
    assert removed.status_code in (200, 404), removed.text
    error = assert_refused(refused, 409, "rerun_input_unavailable")
    assert original["input_file_id"] in error["message"]


# ---- delete -------------------------------------------------------------------------------


async def test_delete_removes_content_and_keeps_receipts(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        rows = [chat_line(f"ok-{i}") for i in range(3)] + [chat_line("bad", "[[sim:status=400]]")]
        batch = await bf.run_batch(rows)
        batch_id = batch["id"]
        store = bf.backfill.store
        record = await store.get_batch(None, batch_id)
        assert record is not None
        out = await bf.rows(batch["output_file_id"])
        request_ids = [r["response"]["request_id"] for r in out]
        ledger_before = await store.ledger(record.org_id)
        blobs_before = blob_names(bf)
        items_before = await count_rows(bf, tables.items, batch_id)

        deleted = await bf.client.delete(f"/v1/batches/{batch_id}")
        after = await bf.client.get(f"/v1/batches/{batch_id}")
        again = await bf.client.delete(f"/v1/batches/{batch_id}")
        rerun = await retry(bf, batch_id)
        files = {
            file_id: (
                (await bf.client.get(f"/v1/files/{file_id}")).status_code,
                (await bf.client.get(f"/v1/files/{file_id}/content")).status_code,
            )
            for file_id in (batch["output_file_id"], batch["error_file_id"])
        }
        receipts = [
            (await bf.client.get(f"/v1/receipts/{request_id}")).status_code
            for request_id in request_ids
        ]
        ledger_after = await store.ledger(record.org_id)
        blobs_after = blob_names(bf)
        items_after = await count_rows(bf, tables.items, batch_id)
        notifications_after = await count_rows(bf, tables.notifications, batch_id)
        listed = (await bf.client.get("/v1/batches")).json()["data"]

    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": batch_id, "object": "batch.deleted", "deleted": True}
    assert after.status_code == 404
    assert_refused(again, 404, "not_found")
    assert_refused(rerun, 404, "not_found")
    assert files == {batch["output_file_id"]: (404, 404), batch["error_file_id"]: (404, 404)}
    result_blobs = {
        batch["output_file_id"],
        batch["error_file_id"],
        f"{batch['error_file_id']}.rerun",
    }
    assert result_blobs <= blobs_before
    assert not result_blobs & blobs_after
    assert items_before == 4
    assert items_after == 0
    assert notifications_after == 0
    assert receipts == [200] * 3
    assert ledger_after == ledger_before
    assert listed == []


async def test_delete_refuses_a_batch_that_has_not_ended(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=1) as (bf, sim):
        running = await bf.submit([chat_line("s", "[[sim:delay_ms=3000]] slow")])
        await eventually(in_flight(sim), lambda n: n == 1, what="the slow line to run")
        refused = await bf.client.delete(f"/v1/batches/{running['id']}")
        reader = await bf.backfill.services.tenants.create_key(
            "default", frozenset({"requests:read"})
        )
        read_only = await bf.client.delete(
            f"/v1/batches/{running['id']}", headers={"Authorization": f"Bearer {reader}"}
        )
        still = await bf.batch(running["id"])

    error = assert_refused(refused, 409, "batch_not_finished")
    assert "cancel" in error["message"]
    assert read_only.status_code == 403, read_only.text
    assert still["status"] in ("in_progress", "finalizing", "completed")


async def test_a_rerun_outlives_the_deleted_original(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=4) as (bf, _):
        original = await bf.run_batch([chat_line("ok"), chat_line("bad", "[[sim:status=400]]")])
        rerun = (await retry(bf, original["id"], **{"Idempotency-Key": "k"})).json()
        await bf.wait(rerun["id"])
        deleted = await bf.client.delete(f"/v1/batches/{original['id']}")
        kept = await bf.batch(rerun["id"])
        replay = await retry(bf, original["id"], **{"Idempotency-Key": "k"})

    assert deleted.status_code == 200, deleted.text
    assert kept["retry_of"] == original["id"]
    assert kept["status"] == "completed"
    # The key still names the rerun it made.
    assert replay.status_code == 200, replay.text
    assert replay.json()["id"] == rerun["id"]
    assert orjson.loads(replay.content)["retry_of"] == original["id"]
