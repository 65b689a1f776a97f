"""The rerun input a finalize keeps beside the error file: the failed lines' requests, written
once, by the attempt that publishes, and removed with every abandoned attempt's blobs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from sqlalchemy import update

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.clock import ManualClock
from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.files import content_key
from backfill.domain.lifecycle import ItemState, Outcome
from backfill.domain.reruns import rerun_key
from backfill.errors import StorageError
from backfill.ports import BlobStore
from backfill.runner.finalize import Finalizer, result_file_id
from backfill.services.result_rows import result_context
from tests.contract.test_finalize_once import (
    COMPLETED,
    FINALIZING,
    LINES,
    NOW,
    CountingBlobs,
    Finalizing,
    finalizing_batch,
    keyring,
    root,
    stored_keys,
    stores,
    worker_blobs,
)

__all__ = ["keyring", "root", "stores"]  # fixtures shared with the finalize contract tests


def request_line(idx: int) -> bytes:
    """Line ``idx`` of the input: 100 bytes, where ``make_batch`` says its lines are."""
    return f'{{"custom_id": "req-{idx}"}}'.encode().ljust(100, b" ")


async def with_input(blobs: CountingBlobs, case: Finalizing) -> None:
    """Store the batch's input: ``make_batch`` puts line i at offset 100 i, 100 bytes long."""
    writer = await blobs.inner.writer(content_key(case.batch.input_file_id))
    await writer.write(b"".join(request_line(i) for i in range(LINES)))
    await writer.commit()


def rerun_of(case: Finalizing) -> bytes:
    failed = [int(custom_id.removeprefix("req-")) for custom_id in case.failed]
    return b"".join(request_line(i) + b"\n" for i in failed)


def published_keys(case: Finalizing, token: str) -> set[str]:
    batch_id = case.batch.id
    error_id = result_file_id(batch_id, "error", token)
    return {
        content_key(result_file_id(batch_id, "output", token)),
        content_key(error_id),
        rerun_key(error_id),
        content_key(case.batch.input_file_id),
    }


async def test_the_rerun_input_holds_the_failed_lines_requests(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    blobs = worker_blobs(root, keyring)
    finalizer = Finalizer(stores[0], blobs, keyring, ManualClock(NOW), 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    await with_input(blobs, case)
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    error_id = result_file_id(case.batch.id, "error", finalizer.token)
    fresh = EncryptedBlobStore(LocalRawStore(root), keyring)
    assert await fresh.read(rerun_key(error_id)) == rerun_of(case)
    assert stored_keys(root) == published_keys(case, finalizer.token)


async def test_no_rerun_input_when_every_line_succeeded(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    blobs = worker_blobs(root, keyring)
    finalizer = Finalizer(stores[0], blobs, keyring, ManualClock(NOW), 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    await with_input(blobs, case)
    i = t.items
    async with stores[0].engine.begin() as conn:
        for custom_id in case.failed:
            idx = int(custom_id.removeprefix("req-"))
            row = orjson.dumps({"custom_id": custom_id, "answer": idx})
            sealed = keyring.seal(row, result_context(case.batch.id, idx))
            await conn.execute(
                update(i)
                .where(i.c.batch_id == case.batch.id, i.c.idx == idx)
                .values(state=ItemState.DONE, outcome=Outcome.OK, result=sealed, error_code=None)
            )
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    error_id = result_file_id(case.batch.id, "error", finalizer.token)
    assert rerun_key(error_id) not in blobs.written
    assert rerun_key(error_id) not in stored_keys(root)


async def test_input_that_cannot_be_read_leaves_no_rerun_input_and_still_publishes(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    blobs = worker_blobs(root, keyring)
    finalizer = Finalizer(stores[0], blobs, keyring, ManualClock(NOW), 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)  # its input was never stored
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    keys = published_keys(case, finalizer.token)
    error_id = result_file_id(case.batch.id, "error", finalizer.token)
    assert stored_keys(root) == keys - {rerun_key(error_id), content_key(case.batch.input_file_id)}


class FailingReads(CountingBlobs):
    """Storage whose reads fail (a passing fault, ``StorageError``) ``failures`` times."""

    def __init__(self, inner: BlobStore, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if self.failures > 0:
            self.failures -= 1
            raise StorageError("storage is down")
        return await super().read(key, start, end)


async def test_a_read_fault_that_passes_keeps_the_rerun_input(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    blobs = FailingReads(EncryptedBlobStore(LocalRawStore(root), keyring), failures=1)
    finalizer = Finalizer(stores[0], blobs, keyring, ManualClock(NOW), 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    await with_input(blobs, case)
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    error_id = result_file_id(case.batch.id, "error", finalizer.token)
    assert await blobs.inner.read(rerun_key(error_id)) == rerun_of(case)


async def test_a_lasting_read_fault_gives_up_the_rerun_input_not_the_batch(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    blobs = FailingReads(EncryptedBlobStore(LocalRawStore(root), keyring), failures=10**6)
    finalizer = Finalizer(stores[0], blobs, keyring, ManualClock(NOW), 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    await with_input(blobs, case)
    assert await finalizer.finalize(case.batch, FINALIZING, COMPLETED)
    got = await stores[0].get_batch(None, case.batch.id)
    assert got is not None
    assert got.status == COMPLETED
    error_id = result_file_id(case.batch.id, "error", finalizer.token)
    assert stored_keys(root) == published_keys(case, finalizer.token) - {rerun_key(error_id)}


async def test_a_late_losers_rerun_input_is_removed(
    stores: list[SqlStore], keyring: Keyring, root: Path
) -> None:
    clock = ManualClock(NOW)
    gate = asyncio.Event()
    slow_blobs = worker_blobs(root, keyring, gate)
    fast_blobs = worker_blobs(root, keyring)
    slow = Finalizer(stores[0], slow_blobs, keyring, clock, 3600, lease_s=120)
    fast = Finalizer(stores[1], fast_blobs, keyring, clock, 3600, lease_s=120)
    case = await finalizing_batch(stores[0], keyring)
    await with_input(fast_blobs, case)

    late = asyncio.create_task(slow.finalize(case.batch, FINALIZING, COMPLETED))
    await asyncio.wait_for(slow_blobs.committing.wait(), 30)
    clock.advance(121)
    assert await fast.finalize(case.batch, FINALIZING, COMPLETED)
    gate.set()
    assert await asyncio.wait_for(late, 30) is False

    slow_error = result_file_id(case.batch.id, "error", slow.token)
    assert rerun_key(slow_error) in slow_blobs.written
    assert stored_keys(root) == published_keys(case, fast.token)
    fast_error = result_file_id(case.batch.id, "error", fast.token)
    assert await fast_blobs.read(rerun_key(fast_error)) == rerun_of(case)
