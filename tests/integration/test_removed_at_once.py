"""A file past its expiry reads as removed at once (SPEC §10.3), on a ManualClock: get, list,
content and batch creation answer before the janitor's sweep exactly what they answer after
it. A file an unfinished batch still reads is kept, as the janitor keeps it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from backfill.adapters.clock import ManualClock
from backfill.services.retention import Janitor
from tests.support import (
    InProcess,
    chat_line,
    in_process_backfill,
    jsonl,
    retained,
    running_simulator,
)

HOUR = 3600
DAY = 24 * HOUR


async def seen(bf: InProcess, file_id: str) -> dict[str, Any]:
    """Everything a user can learn of ``file_id``, less the per-request ids."""
    client = bf.client
    get = await client.get(f"/v1/files/{file_id}")
    content = await client.get(f"/v1/files/{file_id}/content")
    head = await client.head(f"/v1/files/{file_id}/content")
    listed = (await client.get("/v1/files")).json()
    inputs = (await client.get("/v1/files", params={"purpose": "batch"})).json()
    return {
        "get": (get.status_code, get.json()),
        "content": (content.status_code, content.content),
        "head": head.status_code,
        "listed": [f["id"] for f in listed["data"]],
        "inputs": [f["id"] for f in inputs["data"]],
    }


async def refused_creation(bf: InProcess, file_id: str) -> tuple[int, Any]:
    response = await bf.create(file_id)
    assert response.status_code != 200, "a batch was created on a removed file"
    return response.status_code, response.json()


def assert_removed(view: dict[str, Any], file_id: str, why: str) -> None:
    status, body = view["get"]
    assert status == 404
    assert body["error"]["code"] == "not_found"
    assert body["error"]["param"] == "file_id"
    assert file_id in body["error"]["message"]
    assert why in body["error"]["message"]
    assert view["content"][0] == 404
    assert view["head"] == 404
    assert file_id not in view["listed"]
    assert file_id not in view["inputs"]


async def test_accepted_input_reads_as_removed_at_completion(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, _, janitor):
        batch = await bf.run_batch([chat_line("a"), chat_line("b")])
        assert batch["status"] == "completed"
        file_id = batch["input_file_id"]
        before = await seen(bf, file_id)
        creation_before = await refused_creation(bf, file_id)
        assert await janitor.sweep() == 1  # the input, not the results
        after = await seen(bf, file_id)
        creation_after = await refused_creation(bf, file_id)
        output = await bf.client.get(f"/v1/files/{batch['output_file_id']}")
    assert_removed(before, file_id, "expired")
    assert before == after
    assert creation_before == creation_after
    status, body = creation_before
    assert status == 404
    assert body["error"]["param"] == "input_file_id"
    assert "expired" in body["error"]["message"]
    assert "upload it again" in body["error"]["message"]
    assert output.status_code == 200
    assert batch["output_file_id"] in after["listed"]


async def test_unused_input_reads_as_removed_the_second_it_expires(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        content = jsonl([chat_line("a")])
        file = (await bf.upload(content)).json()
        clock.advance(DAY - 1)
        alive = await seen(bf, file["id"])
        clock.advance(1)  # now == expires_at: the janitor's rule is expires_at <= now
        before = await seen(bf, file["id"])
        creation_before = await refused_creation(bf, file["id"])
        assert await janitor.sweep() == 1
        after = await seen(bf, file["id"])
        creation_after = await refused_creation(bf, file["id"])
    assert alive["get"][0] == 200
    assert alive["content"] == (200, content)
    assert alive["listed"] == [file["id"]]
    assert_removed(before, file["id"], "expired")
    assert before == after
    assert creation_before == creation_after


async def test_result_files_read_as_removed_once_expired(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        batch = await bf.run_batch([chat_line("a"), chat_line("bad", "[[sim:status=400]]")])
        await janitor.sweep()  # the input
        clock.advance(7 * DAY)
        ids = (batch["output_file_id"], batch["error_file_id"])
        before = [await seen(bf, file_id) for file_id in ids]
        assert await janitor.sweep() == 2
        after = [await seen(bf, file_id) for file_id in ids]
    for file_id, view in zip(ids, before, strict=True):
        assert_removed(view, file_id, "expired")
        assert "upload it again" not in view["get"][1]["error"]["message"]
    assert before == after


async def test_a_deleted_file_reads_the_same_before_and_after_a_sweep(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, _, janitor):
        file = (await bf.upload(jsonl([chat_line("a")]))).json()
        assert (await bf.client.delete(f"/v1/files/{file['id']}")).status_code == 200
        before = await seen(bf, file["id"])
        await janitor.sweep()
        after = await seen(bf, file["id"])
        again = await bf.client.delete(f"/v1/files/{file['id']}")
    assert_removed(before, file["id"], "was deleted")
    assert before == after
    assert again.status_code == 404


async def test_deleting_an_expired_file_before_the_sweep_removes_it(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        file = (await bf.upload(jsonl([chat_line("a")]))).json()
        clock.advance(DAY)
        deleted = await bf.client.delete(f"/v1/files/{file['id']}")
        swept = await janitor.sweep()
        again = await bf.client.delete(f"/v1/files/{file['id']}")
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert swept == 0, "nothing was left for the janitor"
    assert again.status_code == 404


async def test_expired_input_frees_the_retained_input_quota_at_once(tmp_path: Path) -> None:
    clock = ManualClock()
    rows = jsonl([chat_line("a", "x" * 600)])
    async with (
        running_simulator() as (url, _),
        in_process_backfill(
            tmp_path,
            url,
            clock=clock,
            janitor_interval_s=10**9,
            max_retained_input_bytes=len(rows) + 10,
        ) as bf,
    ):
        assert (await bf.upload(rows)).status_code == 200
        assert (await bf.upload(rows)).status_code == 429
        clock.advance(DAY)  # the first one expired: it is no longer kept for the org
        assert (await bf.upload(rows)).status_code == 200


# ---- kept while an unfinished batch reads it ---------------------------------------------


@asynccontextmanager
async def shared_input(
    tmp_path: Path,
) -> AsyncIterator[tuple[InProcess, ManualClock, Janitor, str, str]]:
    """One input read by two batches that never finish on their own: the first expires an
    hour before the second. Yields with the first ended, the second still in progress."""
    async with retained(tmp_path) as (bf, clock, janitor):
        file = (await bf.upload(jsonl([chat_line("slow", "[[sim:hang]]")]))).json()
        first = (await bf.create(file["id"])).json()
        clock.advance(HOUR)
        second = (await bf.create(file["id"])).json()
        clock.advance(DAY - HOUR + 1)  # the first's window ends
        assert (await bf.wait(first["id"]))["status"] == "expired"
        assert (await bf.client.get(f"/v1/batches/{second['id']}")).json()["status"] == (
            "in_progress"
        )
        yield bf, clock, janitor, file["id"], second["id"]


async def test_input_read_by_an_unfinished_batch_is_kept(tmp_path: Path) -> None:
    async with shared_input(tmp_path) as (bf, clock, janitor, file_id, second):
        # The first batch let its input go at its end; the second still reads it.
        kept = await seen(bf, file_id)
        assert await janitor.sweep() == 0, "the janitor keeps it too"
        clock.advance(HOUR)  # the second's window ends too
        assert (await bf.wait(second))["status"] == "expired"
        before = await seen(bf, file_id)
        swept = await janitor.sweep()
        after = await seen(bf, file_id)
    assert kept["get"][0] == 200
    assert kept["content"][0] == 200
    assert kept["head"] == 200
    assert file_id in kept["inputs"]
    assert_removed(before, file_id, "expired")
    assert swept == 1
    assert before == after


async def test_a_batch_may_still_be_created_on_an_input_in_use(tmp_path: Path) -> None:
    async with shared_input(tmp_path) as (bf, _, janitor, file_id, _second):
        created = await bf.create(file_id)
        await janitor.sweep()
        kept = await bf.client.get(f"/v1/files/{file_id}")
    assert created.status_code == 200, created.text
    assert kept.status_code == 200
