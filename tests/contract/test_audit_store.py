"""The audit log's store, on SQLite and PostgreSQL: the write transaction of an action appends
its row only when it commits, once; retention removes old rows (domain/audit.py)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from sqlalchemy import text

from backfill.adapters.clock import ManualClock
from backfill.adapters.db.store import SqlStore
from backfill.domain import audit
from backfill.domain.audit import ADMIN, AuditScope, Outcome
from backfill.services.audit import AuditLog
from backfill.services.files import FileService
from backfill.services.retention import Janitor


async def test_the_row_commits_with_the_change_and_not_without_it(store: SqlStore) -> None:
    scope = AuditScope(at=1_000.0, address="10.0.0.1", action="test.change", actor=ADMIN)

    async def failing_change() -> None:
        async with store.writing() as conn:
            await conn.execute(text("SELECT 1"))
            raise RuntimeError("the change fails")

    with audit.acting(scope), pytest.raises(RuntimeError):
        await failing_change()
    assert scope.recorded is None
    assert await store.audit_page(before=None, limit=10) == []

    scope = AuditScope(at=1_001.0, address="10.0.0.1", action="test.change", actor=ADMIN)
    with audit.acting(scope):
        async with store.writing():
            pass
        # A second write of the same action appends nothing more.
        async with store.writing():
            pass
    rows = await store.audit_page(before=None, limit=10)
    assert [(r.id, r.action, r.outcome) for r in rows] == [
        (scope.recorded, "test.change", Outcome.SUCCEEDED)
    ]
    # A later step failed: the same row says so.
    await AuditLog(store, store).settle(scope, 409, "conflict")
    (row,) = await store.audit_page(before=None, limit=10)
    assert (row.outcome, row.status, row.error) == (Outcome.FAILED, 409, "conflict")


async def test_writes_outside_an_action_or_before_its_actor_is_known_append_nothing(
    store: SqlStore,
) -> None:
    async with store.writing():
        pass
    scope = AuditScope(at=1.0, address=None, action="test.change")
    with audit.acting(scope):
        async with store.writing():
            pass
    assert scope.recorded is None
    # Unauthenticated: settling records nothing either.
    await AuditLog(store, store).settle(scope, 401, "invalid_api_key")
    assert await store.audit_page(before=None, limit=10) == []


async def test_pages_filters_and_retention(store: SqlStore) -> None:
    log = AuditLog(store, store)
    for at, actor in ((100.0, ADMIN), (200.0, "key_a"), (300.0, "key_b")):
        await log.settle(AuditScope(at=at, address="::1", action="x.y", actor=actor), 200)
    newest = await store.audit_page(before=None, limit=2)
    assert [r.actor for r in newest] == ["key_b", "key_a"]
    older = await store.audit_page(before=newest[-1].id, limit=2)
    assert [r.actor for r in older] == [ADMIN]
    assert [r.actor for r in await store.audit_page(before=None, limit=5, actor="key_a")] == [
        "key_a"
    ]
    assert await store.prune_audit(250.0) == 2
    assert [r.actor for r in await store.audit_page(before=None, limit=5)] == ["key_b"]


async def test_the_janitor_prunes_past_the_retention(store: SqlStore) -> None:
    clock = ManualClock(10 * 86_400.0)
    log = AuditLog(store, store)
    await log.settle(AuditScope(at=1.0, address=None, action="old.one", actor=ADMIN), 200)
    await log.settle(AuditScope(at=9 * 86_400.0, address=None, action="new.one", actor=ADMIN), 200)
    janitor = Janitor(
        store, cast(FileService, _NoFiles()), clock, audit=store, keep_audit_s=5 * 86_400
    )
    await janitor.sweep()
    assert [r.action for r in await store.audit_page(before=None, limit=5)] == ["new.one"]


class _NoFiles:
    async def expired(self, now: int, limit: int) -> list[object]:
        return []


async def test_writes_set_aside_prepare_the_action_and_overlapping_ones_append_once(
    store: SqlStore,
) -> None:
    scope = AuditScope(at=5.0, address=None, action="batch.retry", actor="key_a", target="b_1")
    with audit.acting(scope):
        # A rerun's input file: not the change itself.
        with audit.aside():
            async with store.writing():
                pass
        assert scope.recorded is None
        # The new batch's id does not replace the batch the path names.
        audit.note_target("b_2")

        async def write() -> None:
            async with store.writing():
                await asyncio.sleep(0.01)

        await asyncio.gather(write(), write())
    rows = await store.audit_page(before=None, limit=10)
    assert [(r.action, r.target) for r in rows] == [("batch.retry", "b_1")]
    assert rows[0].id == scope.recorded
