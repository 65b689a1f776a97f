"""One finalizer per batch and one janitor at a time, for workers sharing one database.

Each worker process has its own ``SqlStore`` (its own connections) and its own blob store
(its own caches of blob headers); here they are several of each over one SQLite file or one
PostgreSQL database, and one directory of encrypted blobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from sqlalchemy import event, select, update

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.clock import ManualClock
from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.files import FilePurpose, FileRecord, FileStatus, content_key
from backfill.domain.lifecycle import BatchStatus, ItemState, Outcome
from backfill.domain.records import BatchRecord, FinalizeLease, Org
from backfill.ports import BlobStore, BlobWriter
from backfill.runner.finalize import Finalizer, result_file_id
from backfill.services.files import FileService
from backfill.services.result_rows import result_context
from backfill.services.retention import JANITOR, Janitor
from tests.contract.test_store import _id, make_batch, make_org
from tests.support import stores_on_one_database

NOW = 1_000_000.0
LINES = 7
FINALIZING = BatchStatus.FINALIZING
COMPLETED = BatchStatus.COMPLETED


@pytest.fixture(params=["postgresql", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[SqlStore]]:
    """Three stores over one database, as three worker processes hold them."""
    async with stores_on_one_database(request.param, tmp_path, 3) as made:
        yield made


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(os.urandom(32))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "blobs"


class CountingBlobs:
    """A worker's blob store that records the keys it writes; with ``gate`` its commits wait
    for the gate (after setting ``committing``), to hold an attempt in the middle."""

    def __init__(self, inner: BlobStore, gate: asyncio.Event | None = None) -> None:
        self.inner = inner
        self.written: list[str] = []
        self.gate = gate
        self.committing = asyncio.Event()

    async def writer(self, key: str) -> BlobWriter:
        self.written.append(key)
        return _GatedWriter(await self.inner.writer(key), self)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return await self.inner.read(key, start, end)

    def stream(self, key: str, start: int = 0, end: int | None = None) -> AsyncIterator[bytes]:
        return self.inner.stream(key, start, end)

    async def size(self, key: str) -> int:
        return await self.inner.size(key)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


class _GatedWriter:
    def __init__(self, inner: BlobWriter, owner: CountingBlobs) -> None:
        self._inner = inner
        self._owner = owner

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)

    async def commit(self) -> int:
        if self._owner.gate is not None:
            self._owner.committing.set()
            await self._owner.gate.wait()
        return await self._inner.commit()

    async def abort(self) -> None:
        await self._inner.abort()


def worker_blobs(root: Path, keyring: Keyring, gate: asyncio.Event | None = None) -> CountingBlobs:
    return CountingBlobs(EncryptedBlobStore(LocalRawStore(root), keyring), gate)


def stored_keys(root: Path) -> set[str]:
    folder = root / "files"
    return {f"files/{p.name}" for p in folder.iterdir()} if folder.exists() else set()


@dataclasses.dataclass
class Finalizing:
    batch: BatchRecord
    output: bytes
    """The output file's expected content."""
    failed: list[str]
    """custom_ids of the lines that belong in the error file."""


async def finalizing_batch(store: SqlStore, keyring: Keyring) -> Finalizing:
    """A batch whose lines are all done (every third failed), now ``finalizing``."""
    org = await make_org(store)
    batch = await make_batch(store, org, LINES, model="m")
    output = b""
    failed = []
    i = t.items
    async with store.engine.begin() as conn:
        for idx in range(LINES):
            values: dict[str, Any] = {"state": ItemState.DONE}
            if idx % 3 == 0:
                values.update(outcome=Outcome.ERROR, error_code="engine_unavailable")
                failed.append(f"req-{idx}")
            else:
                row = orjson.dumps({"custom_id": f"req-{idx}", "answer": idx * 11})
                output += row + b"\n"
                values.update(
                    outcome=Outcome.OK, result=keyring.seal(row, result_context(batch.id, idx))
                )
            await conn.execute(
                update(i).where(i.c.batch_id == batch.id, i.c.idx == idx).values(**values)
            )
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], FINALIZING, int(NOW))
    return Finalizing(dataclasses.replace(batch, status=FINALIZING), output, failed)


async def lease_row(store: SqlStore, batch_id: str) -> tuple[str, str | None, float | None]:
    b = t.batches
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                select(b.c.status, b.c.finalizer, b.c.finalize_until).where(b.c.id == batch_id)
            )
        ).one()
    return row.status, row.finalizer, row.finalize_until


def output_files(batch_id: str, token: str) -> set[str]:
    return {content_key(result_file_id(batch_id, kind, token)) for kind in ("output", "error")}


async def assert_published_by(
    store: SqlStore, blobs: BlobStore, case: Finalizing, token: str
) -> None:
    """The batch is completed with ``token``'s files, and they decrypt to the right content."""
    batch_id = case.batch.id
    got = await store.get_batch(None, batch_id)
    assert got is not None
    out_id = result_file_id(batch_id, "output", token)
    err_id = result_file_id(batch_id, "error", token)
    assert (got.status, got.output_file_id, got.error_file_id) == (COMPLETED, out_id, err_id)
    assert await lease_row(store, batch_id) == (COMPLETED, None, None)
    assert await blobs.read(content_key(out_id)) == case.output
    errors = (await blobs.read(content_key(err_id))).splitlines()
    assert [orjson.loads(line)["custom_id"] for line in errors] == case.failed
    record = await store.get_file(case.batch.org_id, out_id)
    assert record is not None
    assert record.bytes == len(case.output)


# ---- the store's leases -------------------------------------------------------------------


async def test_one_statement_decides_who_takes_the_finalize_lease(
    stores: list[SqlStore], keyring: Keyring
) -> None:
    case = await finalizing_batch(stores[0], keyring)
    tokens = [f"tok-{n}" for n in range(9)]
    answers = await asyncio.gather(
        *(
            stores[n % 3].take_finalize(case.batch.id, [FINALIZING], token, NOW + 60, NOW)
            for n, token in enumerate(tokens)
        )
    )
    assert [a.taken for a in answers].count(True) == 1
    winner = tokens[[a.taken for a in answers].index(True)]
    assert answers[tokens.index(winner)] == FinalizeLease(taken=True, previous=None)
    assert await lease_row(stores[0], case.batch.id) == (FINALIZING, winner, NOW + 60)


async def test_a_sole_workers_start_releases_the_finalize_leases_of_before(
    stores: list[SqlStore], keyring: Keyring
) -> None:
    """A worker alone on its database, starting, knows every finalize lease is from a dead
    attempt: the next one takes over at once and learns whose leftovers to remove."""
    case = await finalizing_batch(stores[0], keyring)
    batch_id = case.batch.id
    assert (await stores[0].take_finalize(batch_id, [FINALIZING], "dead", NOW + 120, NOW)).taken
    assert not (await stores[1].take_finalize(batch_id, [FINALIZING], "new", NOW + 5, NOW)).taken
    await stores[1].release_all_leases()
    taken = await stores[1].take_finalize(batch_id, [FINALIZING], "new", NOW + 5, NOW)
    assert taken == FinalizeLease(True, "dead")


async def test_an_expired_holder_is_fenced_out(stores: list[SqlStore], keyring: Keyring) -> None:
    a, b = stores[0], stores[1]
    case = await finalizing_batch(a, keyring)
    batch_id = case.batch.id
    # Only listed statuses can be taken.
    assert not (await a.take_finalize(batch_id, ["in_progress"], "tok-a", NOW + 10, NOW)).taken
    assert await a.take_finalize(batch_id, [FINALIZING], "tok-a", NOW + 10, NOW) == FinalizeLease(
        True, None
    )
    # The holder takes it again (a renewal); nobody else does while it runs.
    assert await a.take_finalize(batch_id, [FINALIZING], "tok-a", NOW + 10, NOW) == FinalizeLease(
        True, "tok-a"
    )
    assert not (await b.take_finalize(batch_id, [FINALIZING], "tok-b", NOW + 15, NOW + 5)).taken
    assert await a.renew_finalize(batch_id, "tok-a", NOW + 20)
    assert not (await b.take_finalize(batch_id, [FINALIZING], "tok-b", NOW + 25, NOW + 15)).taken

    # A stalls past its lease; B takes over and learns whose leftovers to remove.
    taken = await b.take_finalize(batch_id, [FINALIZING], "tok-b", NOW + 80, NOW + 21)
    assert taken == FinalizeLease(True, "tok-a")
    assert not await a.renew_finalize(batch_id, "tok-a", NOW + 90)
    record = FileRecord(
        id="x",
        org_id=case.batch.org_id,
        purpose=FilePurpose.BATCH_OUTPUT,
        filename="x.jsonl",
        bytes=1,
        created_at=int(NOW),
        expires_at=None,
        status=FileStatus.PROCESSED,
        batch_id=batch_id,
    )

    def files(owner: str) -> tuple[FileRecord, FileRecord]:
        return (
            dataclasses.replace(record, id=_id(f"file-{owner}")),
            dataclasses.replace(record, id=_id(f"file-{owner}")),
        )

    a_out, a_err = files("a")
    assert not await a.publish(batch_id, FINALIZING, COMPLETED, 50, a_out, a_err, token="tok-a")
    assert await a.get_file(case.batch.org_id, a_out.id) is None
    # A release by a holder that lost the lease changes nothing.
    await a.release_finalize(batch_id, "tok-a")
    assert await lease_row(a, batch_id) == (FINALIZING, "tok-b", NOW + 80)

    b_out, b_err = files("b")
    assert await b.publish(batch_id, FINALIZING, COMPLETED, 60, b_out, b_err, token="tok-b")
    got = await a.get_batch(None, batch_id)
    assert got is not None
    assert (got.status, got.output_file_id, got.completed_at) == (COMPLETED, b_out.id, 60)
    assert await lease_row(a, batch_id) == (COMPLETED, None, None)
    # A published batch is over: there is no lease to take on it any more.
    assert not (await a.take_finalize(batch_id, [FINALIZING], "tok-a", NOW + 200, NOW + 100)).taken


async def test_a_released_lease_is_free_and_names_its_last_holder(
    stores: list[SqlStore], keyring: Keyring
) -> None:
    a, b = stores[0], stores[1]
    case = await finalizing_batch(a, keyring)
    batch_id = case.batch.id
    assert (await a.take_finalize(batch_id, [FINALIZING], "tok-a", NOW + 60, NOW)).taken
    await a.release_finalize(batch_id, "tok-a")
    assert await lease_row(a, batch_id) == (FINALIZING, "tok-a", None)
    taken = await b.take_finalize(batch_id, [FINALIZING], "tok-b", NOW + 61, NOW + 1)
    assert taken == FinalizeLease(True, "tok-a")


async def test_one_singleton_holder_at_a_time(stores: list[SqlStore]) -> None:
    holders = [f"holder-{n}" for n in range(9)]

    async def take(n: int, until: float, now: float) -> bool:
        return await stores[n % 3].take_singleton(JANITOR, holders[n], until, now)

    wins = await asyncio.gather(*(take(n, NOW + 60, NOW) for n in range(len(holders))))
    assert wins.count(True) == 1
    first = wins.index(True)
    others = [n for n in range(len(holders)) if n != first]
    # The holder renews; the others stay out until its lease ends.
    assert await take(first, NOW + 120, NOW + 30)
    assert not any(await asyncio.gather(*(take(n, NOW + 200, NOW + 90) for n in others)))
    # Another name is another lease.
    assert await stores[0].take_singleton("other", holders[others[0]], NOW + 60, NOW)

    wins = await asyncio.gather(*(take(n, NOW + 300, NOW + 121) for n in others))
    assert wins.count(True) == 1
    assert not await take(first, NOW + 400, NOW + 200)


# ---- the finalizer ------------------------------------------------------------------------


async def test_racing_finalizers_publish_once(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    blobs = [worker_blobs(root, keyring) for _ in stores]
    finalizers = [
        Finalizer(store, blob, keyring, clock, 3600, lease_s=120)
        for store, blob in zip(stores, blobs, strict=True)
    ]
    published: set[str] = set()
    for _ in range(4):
        case = await finalizing_batch(stores[0], keyring)
        results = await asyncio.gather(
            *(f.finalize(case.batch, FINALIZING, COMPLETED) for f in finalizers)
        )
        assert results.count(True) == 1
        winner = results.index(True)
        token = finalizers[winner].token
        # The blobs were written once, by the winner: the others never started writing.
        assert sorted(blobs[winner].written) == sorted(output_files(case.batch.id, token))
        assert all(not b.written for n, b in enumerate(blobs) if n != winner)
        for b in blobs:
            b.written.clear()
        published |= output_files(case.batch.id, token)
        # Readable by every worker's blob store and by a fresh one.
        readers: list[BlobStore] = [*blobs, EncryptedBlobStore(LocalRawStore(root), keyring)]
        for reader in readers:
            await assert_published_by(stores[1], reader, case, token)
    assert stored_keys(root) == published


async def test_a_late_loser_neither_publishes_nor_overwrites(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    gate = asyncio.Event()
    slow_blobs = worker_blobs(root, keyring, gate)
    fast_blobs = worker_blobs(root, keyring)
    slow = Finalizer(stores[0], slow_blobs, keyring, clock, 3600, lease_s=120)
    fast = Finalizer(stores[1], fast_blobs, keyring, clock, 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)

    late = asyncio.create_task(slow.finalize(case.batch, FINALIZING, COMPLETED))
    await asyncio.wait_for(slow_blobs.committing.wait(), 30)
    # While the slow attempt's lease runs, the other worker leaves the batch alone.
    assert not await fast.finalize(case.batch, FINALIZING, COMPLETED)
    assert fast_blobs.written == []

    # The slow one stalls past its lease; the other takes over and publishes.
    clock.advance(121)
    assert await fast.finalize(case.batch, FINALIZING, COMPLETED)
    await assert_published_by(stores[2], fast_blobs, case, fast.token)
    # The stalled attempt wakes up, finishes its blobs and is refused at publish.
    gate.set()
    assert await asyncio.wait_for(late, 30) is False

    # Nothing of the stalled attempt is left, and the published file is intact for every
    # reader, the stalled worker's (which may have cached blob headers) included.
    assert stored_keys(root) == output_files(case.batch.id, fast.token)
    readers: list[BlobStore] = [slow_blobs, fast_blobs]
    readers.append(EncryptedBlobStore(LocalRawStore(root), keyring))
    for reader in readers:
        await assert_published_by(stores[0], reader, case, fast.token)


async def test_a_finalizer_that_cannot_renew_stops_without_publishing(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    gate = asyncio.Event()
    blobs = worker_blobs(root, keyring, gate)
    # A short lease: the finalizer tries to renew it every 0.1 s of real time.
    slow = Finalizer(stores[0], blobs, keyring, clock, 3600, lease_s=0.3)
    case = await finalizing_batch(stores[0], keyring)
    task = asyncio.create_task(slow.finalize(case.batch, FINALIZING, COMPLETED))
    await asyncio.wait_for(blobs.committing.wait(), 30)
    # Another worker, whose clock is well past any renewal this one can make, takes over.
    clock.advance(1)
    other_now = clock.now() + 10
    taken = await stores[1].take_finalize(
        case.batch.id, [FINALIZING], "tok-b", other_now + 100, other_now
    )
    assert taken == FinalizeLease(True, slow.token)
    await asyncio.sleep(0.5)
    gate.set()
    assert await asyncio.wait_for(task, 30) is False
    assert await lease_row(stores[0], case.batch.id) == (FINALIZING, "tok-b", other_now + 100)
    assert stored_keys(root) == set()


async def test_before_runs_only_once_the_lease_is_held(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    finalizer = Finalizer(stores[0], worker_blobs(root, keyring), keyring, clock, 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    seen: list[tuple[str, str | None, float | None]] = []

    def before() -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            seen.append(await lease_row(stores[0], case.batch.id))

        return run

    assert (
        await stores[1].take_finalize(case.batch.id, [FINALIZING], "tok-x", NOW + 60, NOW)
    ).taken
    assert not await finalizer.finalize(case.batch, FINALIZING, COMPLETED, before=before())
    assert seen == []
    clock.advance(61)
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED, before=before())
    assert seen == [(FINALIZING, finalizer.token, clock.now() + 120)]


async def test_one_finalizer_does_not_finalize_a_batch_twice_at_once(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    gate = asyncio.Event()
    blobs = worker_blobs(root, keyring, gate)
    finalizer = Finalizer(stores[0], blobs, keyring, clock, 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    first = asyncio.create_task(finalizer.finalize(case.batch, FINALIZING, COMPLETED))
    await asyncio.wait_for(blobs.committing.wait(), 30)
    # Its own token would pass the lease; the second call still backs off.
    assert not await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    gate.set()
    assert await asyncio.wait_for(first, 30)
    assert len(blobs.written) == 2


# ---- the janitor --------------------------------------------------------------------------


class RemovingFiles:
    """The part of ``FileService`` the janitor uses: counts removals per janitor."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.removed: list[str] = []

    async def expired(self, now: int, limit: int) -> list[FileRecord]:
        return await self.store.expired_files(now, limit)

    async def remove(self, record: FileRecord) -> None:
        self.removed.append(record.id)
        await asyncio.sleep(0)  # let the other janitors run between removals
        await self.store.mark_file_deleted(record.id)


async def expired_file(store: SqlStore, org: Org, age: int) -> FileRecord:
    record = FileRecord(
        id=_id("file-"),
        org_id=org.id,
        purpose=FilePurpose.BATCH,
        filename="expired.jsonl",
        bytes=1,
        created_at=int(NOW),
        expires_at=int(NOW) - age,
        status=FileStatus.PROCESSED,
    )
    await store.create_file(record)
    return record


async def test_one_janitor_sweeps_at_a_time(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    for age in range(12):
        await expired_file(stores[0], org, age)
    clock = ManualClock(NOW)
    files = [RemovingFiles(store) for store in stores]
    janitors = [
        Janitor(store, cast(FileService, f), clock, lease_s=120)
        for store, f in zip(stores, files, strict=True)
    ]
    swept = await asyncio.gather(*(j.sweep(batch_size=5) for j in janitors))
    assert sorted(swept) == [0, 0, 12]
    assert sum(len(f.removed) for f in files) == 12
    holder = swept.index(12)
    other = (holder + 1) % 3

    # The others keep out while the holder's lease runs; the holder sweeps again.
    late = await expired_file(stores[0], org, 1)
    clock.advance(60)
    assert await janitors[other].sweep() == 0
    assert await janitors[holder].sweep() == 1
    assert files[holder].removed[-1] == late.id

    # The holder stops (its lease was renewed at NOW + 60); another takes over after it ends.
    later = await expired_file(stores[0], org, 1)
    clock.advance(121)
    assert await janitors[other].sweep() == 1
    assert files[other].removed == [later.id]
    assert await janitors[holder].sweep() == 0


# ---- the janitor's query ------------------------------------------------------------------


async def _explain_expired_files(store: SqlStore) -> str:
    """The plan of the statement ``expired_files`` sends, as sent (parameters included)."""
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "FROM files" in statement and "expires_at" in statement:
            sent.append((statement, params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    try:
        await store.expired_files(int(NOW), 10)
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    assert len(sent) == 1
    statement, params = sent[0]
    async with store.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        if store.is_sqlite:
            cursor = await driver.execute("EXPLAIN QUERY PLAN " + statement, params)
            return "\n".join(str(row[-1]) for row in await cursor.fetchall())
        # A tiny table is cheaper to scan; the question is whether the index can serve the
        # query at all, and from the generic plan PostgreSQL may settle on for a statement
        # the driver keeps prepared, where parameters are unknown.
        values = ", ".join(_sql_literal(p) for p in params)
        await driver.execute("SET enable_seqscan = off")
        await driver.execute("SET plan_cache_mode = force_generic_plan")
        await driver.execute(f"PREPARE expired_files AS {statement}")
        try:
            rows = await driver.fetch(f"EXPLAIN EXECUTE expired_files({values})")
        finally:
            await driver.execute("DEALLOCATE expired_files")
            await driver.execute("RESET enable_seqscan")
            await driver.execute("RESET plan_cache_mode")
        return "\n".join(row[0] for row in rows)


def _sql_literal(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    assert isinstance(value, str)
    return "'" + value.replace("'", "''") + "'"


async def test_the_janitors_query_reads_the_expiring_index(stores: list[SqlStore]) -> None:
    store = stores[0]
    org = await make_org(store)
    for n in range(50):
        await store.create_file(
            FileRecord(
                id=_id("file-"),
                org_id=org.id,
                purpose=FilePurpose.BATCH,
                filename=f"{n}.jsonl",
                bytes=1,
                created_at=int(NOW),
                expires_at=int(NOW) + (n - 25) * 60,
                status=FileStatus.DELETED if n % 2 else FileStatus.PROCESSED,
            )
        )
    if not store.is_sqlite:
        async with store.engine.begin() as conn:
            await conn.exec_driver_sql("ANALYZE files")
    plan = await _explain_expired_files(store)
    assert "ix_files_expiring" in plan, plan
    # Which input files unfinished batches still read: found by status, not by a scan of
    # every batch there ever was.
    assert "ix_batches_status_expires" in plan, plan
    expired = await store.expired_files(int(NOW), 100)
    expires = [f.expires_at for f in expired if f.expires_at is not None]
    assert len(expires) == 13
    assert expires == sorted(expires)
    assert all(f.status != "deleted" for f in expired)
