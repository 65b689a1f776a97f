"""The store's part in rerunning and deleting ended batches, on SQLite and PostgreSQL: where
each line's request is (for the rerun input), and deleting a batch with its items and
notifications while its receipts stay."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import func, insert, select

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.files import FilePurpose, FileRecord, FileStatus
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord, Org
from tests.contract.test_group_commit import CREDIT, lease, priced_batch, result
from tests.contract.test_store import NOW, all_results, file_record, make_batch, make_org

TOKEN = "tok-w"


async def rows_of(store: SqlStore, table: Any, batch_id: str) -> int:
    async with store.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.batch_id == batch_id)
        return int((await conn.execute(query)).scalar_one())


async def add_notification(store: SqlStore, batch: BatchRecord) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(
            insert(t.notifications).values(
                id=f"msg_{batch.id}",
                org_id=batch.org_id,
                batch_id=batch.id,
                channel="webhook",
                target="https://hooks.example/batch",
                event="batch.completed",
                payload={"batch_id": batch.id},
                created_at=int(NOW),
                next_at=NOW,
                # Delivered: one still pending is sent to its end even after a delete.
                state=1,
            )
        )


async def ended_batch(store: SqlStore, org: Org) -> tuple[BatchRecord, FileRecord, FileRecord]:
    """A catalog batch of four lines (the last failed) published ``completed`` with result
    files, one receipt per successful line, and a notification row."""
    await store.credit(org.id, CREDIT, None, int(NOW))
    batch = await priced_batch(store, org, 4)
    await lease(store, batch.id, TOKEN)
    results = [result(batch.id, idx, TOKEN, ok=idx < 3) for idx in range(4)]
    assert await store.write_results(results) == [True] * 4
    finalizing = BatchStatus.FINALIZING
    assert (await store.take_finalize(batch.id, [finalizing], "fin", NOW + 60, NOW)).taken
    out = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    err = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    completed = BatchStatus.COMPLETED
    assert await store.publish(batch.id, finalizing, completed, int(NOW), out, err, token="fin")
    await add_notification(store, batch)
    return dataclasses.replace(batch, status=completed), out, err


async def test_results_say_where_each_line_is_in_the_input(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 3)
    results = await all_results(store, batch.id)
    assert [(r.idx, r.offset, r.length) for r in results] == [
        (0, 0, 100),
        (1, 100, 100),
        (2, 200, 100),
    ]


async def test_delete_batch_removes_the_batch_and_keeps_its_receipts(store: SqlStore) -> None:
    org = await make_org(store)
    batch, out, err = await ended_batch(store, org)
    assert await rows_of(store, t.receipts, batch.id) == 3
    assert await rows_of(store, t.notifications, batch.id) == 1
    ledger = await store.ledger(org.id)

    later = int(NOW) + 50
    assert sorted(await store.delete_batch(org.id, batch.id, later) or []) == sorted(
        [out.id, err.id]
    )

    assert await store.get_batch(None, batch.id) is None
    assert (await store.list_batches(org.id, None, 10)).items == []
    assert await rows_of(store, t.items, batch.id) == 0
    assert await rows_of(store, t.notifications, batch.id) == 0
    assert await rows_of(store, t.receipts, batch.id) == 3
    assert await store.ledger(org.id) == ledger
    # The result files are due now, so the janitor removes them if the caller does not.
    for record in (out, err):
        stored = await store.get_file(org.id, record.id)
        assert stored is not None
        assert (stored.status, stored.expires_at) == (FileStatus.PROCESSED, later)
    due = {f.id for f in await store.expired_files(later, 100)}
    assert {out.id, err.id} <= due
    # A second delete finds nothing.
    assert await store.delete_batch(org.id, batch.id, later) is None


async def test_delete_batch_leaves_running_and_other_orgs_batches(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    running = await make_batch(store, org, 2)
    ended, out, _ = await ended_batch(store, org)

    assert await store.delete_batch(org.id, running.id, int(NOW)) is None
    assert await store.delete_batch(other.id, ended.id, int(NOW)) is None

    still = await store.get_batch(org.id, running.id)
    assert still is not None
    assert still.status == BatchStatus.IN_PROGRESS
    assert await rows_of(store, t.items, running.id) == 2
    kept = await store.get_batch(org.id, ended.id)
    assert kept is not None
    assert kept.status == BatchStatus.COMPLETED
    assert await rows_of(store, t.items, ended.id) == 4
    file = await store.get_file(org.id, out.id)
    assert file is not None
    assert file.expires_at == out.expires_at


async def test_a_deleted_batch_without_result_files_is_deleted_too(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    errors = [{"code": "input_unavailable", "message": "gone", "param": None, "line": None}]
    assert await store.fail_batch(batch.id, BatchStatus.IN_PROGRESS, int(NOW), errors)
    assert await store.delete_batch(org.id, batch.id, int(NOW)) == []
    assert await store.get_batch(org.id, batch.id) is None
