"""Batch creation when the input cannot be read (SPEC §4.1, §7.3): nothing half-created holds
credit. Unreadable input is refused before anything is committed; input that vanishes while
its batch is being enqueued fails that batch and gives the reservation back; a passing fault
leaves the batch ``validating`` and it starts once storage works again; a batch the start-up
resume cannot enqueue fails, and the process keeps running.

Faults are real: blobs are deleted from the local store, or its reads fail with EIO.
"""

from __future__ import annotations

import asyncio
import errno
import os
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import backfill.container
import backfill.services.batches
from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.clock import SystemClock
from backfill.adapters.db import tables as t
from backfill.domain.chunks import chunked
from backfill.domain.files import ACCEPTED_INPUT_GRACE_S
from backfill.errors import StorageError
from backfill.services.batches import BatchStarter
from backfill.settings import Settings
from backfill.simulator.server import Simulator
from tests.support import (
    InProcess,
    assert_exactly_once,
    backfill_on_raw_store,
    chat_line,
    in_process_backfill,
    jsonl,
)

Sim = tuple[str, Simulator]
ROWS = [chat_line(f"req-{i}") for i in range(20)]


class FaultyReads(LocalRawStore):
    """The real local store. Reads of a blob in ``vanish`` past its header delete it first;
    reads of a blob in ``eio`` fail with EIO as many times as it says."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.vanish: set[str] = set()
        self.eio: dict[str, int] = {}

    async def read(self, key: str, start: int, length: int) -> bytes:
        if start > 0 and key in self.vanish:
            self._path(key).unlink(missing_ok=True)
        if start > 0 and self.eio.get(key, 0) > 0:
            self.eio[key] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return await super().read(key, start, length)


def faulty_backfill(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> AbstractAsyncContextManager[tuple[InProcess, FaultyReads]]:
    return backfill_on_raw_store(tmp_path, sim[0], monkeypatch, FaultyReads, **overrides)


async def uploaded(bf: InProcess) -> str:
    response = await bf.upload(jsonl(ROWS))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


async def org_reserved(bf: InProcess) -> int:
    async with bf.backfill.store.engine.connect() as conn:
        return int((await conn.execute(select(t.orgs.c.reserved))).scalar_one())


def blob(bf: InProcess, key: str) -> Path:
    return bf.settings.resolved_storage_path / key


async def test_unreadable_input_is_refused_before_anything_is_committed(
    tmp_path: Path, sim: Sim
) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        file_id = await uploaded(bf)
        blob(bf, f"files/{file_id}").unlink()
        response = await bf.create(file_id)
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "input_unavailable", error
        assert error["param"] == "input_file_id"
        assert file_id in error["message"]
        assert "upload it again" in error["message"]
        assert response.headers["x-should-retry"] == "false"
        assert (await bf.client.get("/v1/batches")).json()["data"] == []
        assert await org_reserved(bf) == 0


async def test_input_vanishing_during_enqueue_fails_the_batch_and_frees_its_credit(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with faulty_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        file_id = await uploaded(bf)
        raw.vanish.add(f"files/{file_id}.index")
        response = await bf.create(file_id)
        assert response.status_code == 200, response.text
        batch = response.json()
        assert batch["status"] == "failed", batch
        assert batch["failed_at"] is not None
        [error] = batch["errors"]["data"]
        assert error["code"] == "input_unavailable"
        assert error["param"] == "input_file_id"
        again = (await bf.client.get(f"/v1/batches/{batch['id']}")).json()
        assert again["status"] == "failed"
        assert await org_reserved(bf) == 0
        # A failed creation does not count toward the unfinished-batch limit.
        other = await uploaded(bf)
        for _ in range(bf.settings.limits.max_unfinished_batches):
            created = await bf.create(other)
            assert created.status_code == 200, created.text


async def test_passing_fault_during_enqueue_starts_the_batch_later(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with faulty_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        bf.backfill.services.batches.enqueue_retry_base_s = 0.05
        file_id = await uploaded(bf)
        index = f"files/{file_id}.index"
        raw.eio[index] = 3
        response = await bf.create(file_id)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "validating"
        batch = await bf.wait(response.json()["id"], timeout_s=30)
        assert batch["status"] == "completed", batch
        assert raw.eio[index] == 0, "the fault was never hit"
        out = await bf.rows(batch["output_file_id"])
        err = await bf.rows(batch["error_file_id"])
        assert_exactly_once(ROWS, out, err)
        assert batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        assert await org_reserved(bf) == 0


async def test_resume_fails_a_batch_it_cannot_enqueue_and_resumes_the_rest(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What start-up does with batches left ``validating`` (a crash between a batch row and
    its items, or a fault that outlasted the process)."""
    async with faulty_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        batches = bf.backfill.services.batches
        batches.enqueue_retry_base_s = 3600.0  # only the resume below acts
        lost_file, kept_file = await uploaded(bf), await uploaded(bf)
        for file_id in (lost_file, kept_file):
            raw.eio[f"files/{file_id}.index"] = 1
        lost = (await bf.create(lost_file)).json()
        kept = (await bf.create(kept_file)).json()
        assert [lost["status"], kept["status"]] == ["validating", "validating"]
        assert await org_reserved(bf) > 0
        raw.vanish.add(f"files/{lost_file}.index")

        await batches.resume_interrupted()

        failed = (await bf.client.get(f"/v1/batches/{lost['id']}")).json()
        assert failed["status"] == "failed", failed
        assert failed["errors"]["data"][0]["code"] == "input_unavailable"
        resumed = await bf.wait(kept["id"])
        assert resumed["status"] == "completed", resumed
        assert resumed["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        assert await org_reserved(bf) == 0


# ---- a batch left validating always ends somewhere -------------------------------------------


async def test_lifecycle_starts_a_batch_whose_creating_process_stopped_retrying(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in an API-only deployment, or after the process that created it crashed: nobody in
    the creating process retries; a worker's lifecycle starts the batch."""
    # No grace: the worker takes a validating batch over at once.
    async with faulty_backfill(tmp_path, sim, monkeypatch, validating_grace_s=0.0) as (bf, raw):
        bf.backfill.services.batches.enqueue_retry_base_s = 3600.0
        file_id = await uploaded(bf)
        raw.eio[f"files/{file_id}.index"] = 1
        created = (await bf.create(file_id)).json()
        assert created["status"] == "validating", created

        batch = await bf.wait(created["id"], timeout_s=30)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        assert_exactly_once(ROWS, await bf.rows(batch["output_file_id"]), [])
        assert await org_reserved(bf) == 0


async def test_background_retry_survives_a_database_error(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry's own status read fails once: the retry goes on instead of ending quietly."""
    async with faulty_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        batches = bf.backfill.services.batches
        batches.enqueue_retry_base_s = 0.05
        file_id = await uploaded(bf)
        raw.eio[f"files/{file_id}.index"] = 1
        store = bf.backfill.store
        real_get = store.get_batch
        failed: list[str] = []

        async def get_batch(org_id: str | None, batch_id: str) -> Any:
            if org_id is None and not failed:  # the retry's read, not the API's
                failed.append(batch_id)
                raise StorageError("The database failed while reading a batch: OSError.")
            return await real_get(org_id, batch_id)

        monkeypatch.setattr(store, "get_batch", get_batch)
        created = (await bf.create(file_id)).json()
        assert created["status"] == "validating", created

        batch = await bf.wait(created["id"], timeout_s=20)
        assert failed == [created["id"]], "the retry never met the fault"
        assert batch["status"] == "completed", batch
        assert await org_reserved(bf) == 0


async def test_batch_still_validating_when_its_window_ends_expires(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC §4.6: it becomes ``expired``, every line gets a ``batch_expired`` error row, and
    its reservation is given back."""
    made: list[FaultyReads] = []

    def raw_store(settings: Settings) -> FaultyReads:
        made.append(FaultyReads(settings.resolved_storage_path))
        return made[-1]

    monkeypatch.setattr(backfill.container, "_raw_store", raw_store)
    async with in_process_backfill(tmp_path, sim[0], min_completion_window_s=1) as bf:
        [raw] = made
        bf.backfill.services.batches.enqueue_retry_base_s = 3600.0
        file_id = await uploaded(bf)
        raw.eio[f"files/{file_id}.index"] = 1
        created = (await bf.create(file_id, completion_window="2s")).json()
        assert created["status"] == "validating", created
        assert await org_reserved(bf) > 0

        batch = await bf.wait(created["id"], timeout_s=30)
        assert batch["status"] == "expired", batch
        assert batch["expired_at"] is not None
        assert batch["request_counts"] == {"total": 20, "completed": 0, "failed": 20}
        err = await bf.rows(batch["error_file_id"])
        assert_exactly_once(ROWS, await bf.rows(batch["output_file_id"]), err)
        assert {row["error"]["code"] for row in err} == {"batch_expired"}
        assert await org_reserved(bf) == 0


async def test_input_expiry_is_set_with_the_batch_row(tmp_path: Path, sim: Sim) -> None:
    """Nothing after the batch row is committed can turn an accepted creation into a 503."""
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        store = bf.backfill.store
        file_id = await uploaded(bf)
        response = await bf.create(file_id)
        assert response.status_code == 200, response.text
        created = response.json()
        async with store.engine.connect() as conn:
            expires = (
                await conn.execute(select(t.files.c.expires_at).where(t.files.c.id == file_id))
            ).scalar_one()
        assert expires == created["expires_at"] + ACCEPTED_INPUT_GRACE_S
        batch = await bf.wait(created["id"])
        assert batch["status"] == "completed", batch


# ---- cancel racing the enqueue ------------------------------------------------------------


async def test_cancel_between_enqueue_chunks_leaves_no_item_behind(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is cancelled, and finished, after its creation read the input and before it
    stored the items: none are stored under the finished batch."""
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        store = bf.backfill.store
        real_add = store.add_items

        async def add_items(batch_id: str, lines: Any) -> bool:
            cancelled = await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
            assert cancelled.status_code == 200, cancelled.text
            assert (await bf.wait(batch_id, timeout_s=10))["status"] == "cancelled"
            added: bool = await real_add(batch_id, lines)
            return added

        monkeypatch.setattr(store, "add_items", add_items)
        file_id = await uploaded(bf)
        created = await bf.create(file_id)
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["status"] == "cancelled", batch

        async with store.engine.connect() as conn:
            items = (
                await conn.execute(
                    select(func.count())
                    .select_from(t.items)
                    .where(t.items.c.batch_id == batch["id"])
                )
            ).scalar_one()
        assert items == 0
        assert await org_reserved(bf) == 0


# ---- a large batch is queued after its creation answers ----------------------------------------


async def test_large_batch_answers_validating_and_is_queued_once_in_the_background(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its creation answers before its lines are queued; the worker's takeover of batches left
    ``validating`` (no grace here) does not queue it a second time meanwhile."""
    async with in_process_backfill(tmp_path, sim[0], validating_grace_s=0.0) as bf:
        bf.backfill.services.batches.answer_early_lines = 5
        store = bf.backfill.store
        real_add = store.add_items
        gate = asyncio.Event()
        entered: list[str] = []

        async def add_items(batch_id: str, chunks: Any) -> bool:
            entered.append(batch_id)
            await gate.wait()
            return await real_add(batch_id, chunks)

        monkeypatch.setattr(store, "add_items", add_items)
        created = (await bf.create(await uploaded(bf))).json()
        assert created["status"] == "validating", created
        assert created["request_counts"]["total"] == 20
        # Several lifecycle rounds see the batch validating past its grace.
        await asyncio.sleep(1.0)
        assert entered == [created["id"]]
        gate.set()

        batch = await bf.wait(created["id"], timeout_s=30)
        assert batch["status"] == "completed", batch
        assert_exactly_once(ROWS, await bf.rows(batch["output_file_id"]), [])
        assert await org_reserved(bf) == 0


async def test_queueing_stopped_by_shutdown_resumes_at_the_next_start(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        batches = bf.backfill.services.batches
        batches.answer_early_lines = 5
        files = bf.backfill.services.files
        store = bf.backfill.store
        # Pages of 5 lines, a chunk each, so that queueing takes several statements.
        real_lines, real_add = files.lines, store.add_items
        monkeypatch.setattr(files, "lines", lambda file_id: real_lines(file_id, chunk=5))
        monkeypatch.setattr(backfill.services.batches, "chunked", partial(chunked, max_lines=5))
        gate, storing = asyncio.Event(), asyncio.Event()
        pages: list[int] = []

        async def add_items(batch_id: str, chunks: Any) -> bool:
            pages.append(len(chunks))
            if len(pages) == 2:
                storing.set()
                await gate.wait()  # the page being stored when the shutdown comes
            return await real_add(batch_id, chunks)

        monkeypatch.setattr(store, "add_items", add_items)
        created = (await bf.create(await uploaded(bf))).json()
        await asyncio.wait_for(storing.wait(), 30)
        stopping = asyncio.create_task(batches.stop())
        await asyncio.sleep(0.1)
        assert not stopping.done(), "the shutdown cut the page being stored short"
        gate.set()
        await stopping
        assert len(pages) == 2, "queueing went on after the shutdown"
        status = (await bf.client.get(f"/v1/batches/{created['id']}")).json()["status"]
        assert status == "validating"
        record = await store.get_batch(None, created["id"])
        assert record is not None

        # The next start's resume, with a starter of its own as a new process would have.
        starter = BatchStarter(store, files, SystemClock())
        assert await starter.start(record)
        batch = await bf.wait(created["id"], timeout_s=30)
        assert batch["status"] == "completed", batch
        assert_exactly_once(ROWS, await bf.rows(batch["output_file_id"]), [])
