"""File listings and the retained-input total with ``now`` (SQLite and PostgreSQL): a file past
its expiry that no unfinished batch reads is left out before the janitor deletes it, by the
same rule as ``expired_files``."""

from __future__ import annotations

from sqlalchemy import update

from backfill.adapters.db import tables
from backfill.adapters.db.store import SqlStore
from backfill.domain.files import FilePurpose
from backfill.domain.records import BatchRecord, Org
from tests.contract.test_store import NOW, file_record, make_batch, make_org

T = int(NOW)


async def make_busy_input(store: SqlStore, org: Org) -> BatchRecord:
    """An unfinished batch whose input is past its expiry (as when another batch reading the
    same file ended and let it go): the janitor keeps it, and so must every reader."""
    batch = await make_batch(store, org)
    async with store.engine.begin() as conn:
        await conn.execute(
            update(tables.files)
            .where(tables.files.c.id == batch.input_file_id)
            .values(expires_at=T - 100)
        )
    return batch


async def test_listing_with_now_leaves_out_what_the_janitor_removes_next(store: SqlStore) -> None:
    org = await make_org(store)
    kept = file_record(org, expires_at=T + 1)
    due = file_record(org, expires_at=T)  # expires_at <= now: due, as for the janitor
    output = file_record(org, FilePurpose.BATCH_OUTPUT, expires_at=T - 5)
    forever = file_record(org, expires_at=None)
    for record in (kept, due, output, forever):
        await store.create_file(record)
    busy = await make_busy_input(store, org)
    listed = await store.list_files(org.id, None, None, 10, ascending=True, now=T)
    due_now = {f.id for f in await store.expired_files(T, 100)}
    everything = await store.list_files(org.id, None, None, 10, ascending=True)

    assert {f.id for f in listed.items} == {kept.id, forever.id, busy.input_file_id}
    assert due_now == {due.id, output.id}
    assert {f.id for f in listed.items}.isdisjoint(due_now)
    assert {f.id for f in everything.items} == {
        kept.id,
        due.id,
        output.id,
        forever.id,
        busy.input_file_id,
    }


async def test_retained_input_with_now_counts_only_inputs_still_kept(store: SqlStore) -> None:
    org = await make_org(store)
    await store.create_file(file_record(org, bytes=100, expires_at=T + 1))
    await store.create_file(file_record(org, bytes=20, expires_at=T))
    await store.create_file(file_record(org, FilePurpose.BATCH_OUTPUT, bytes=7, expires_at=T + 1))
    await make_busy_input(store, org)  # 10 bytes, past its expiry, kept while read
    assert await store.retained_input_bytes(org.id) == 130
    assert await store.retained_input_bytes(org.id, T) == 110
