"""``Store`` over SQLAlchemy Core: the one place with SQL and dialect differences."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import fields
from typing import Any

from sqlalchemy import and_, event, func, insert, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from backfill.adapters.db import tables as t
from backfill.adapters.db.migrate import upgrade
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState, Outcome
from backfill.errors import Conflict
from backfill.ports import (
    ApiKey,
    BatchRecord,
    ClaimedItem,
    FileRecord,
    ItemResult,
    LineRef,
    Org,
    Page,
    StoredResult,
)

_BATCH_FIELDS = [f.name for f in fields(BatchRecord)]
_FILE_FIELDS = [f.name for f in fields(FileRecord)]
_INSERT_CHUNK = 5000
_RESULT_PAGE = 1000


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; FULL makes every commit survive power loss,
    # which is what "a result counts once it is durably stored" needs.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _batch(row: Any) -> BatchRecord:
    data = dict(row._mapping)
    return BatchRecord(**{k: data[k] for k in _BATCH_FIELDS})


def _file(row: Any) -> FileRecord:
    data = dict(row._mapping)
    return FileRecord(**{k: data[k] for k in _FILE_FIELDS})


class SqlStore:
    """A ``Store`` on SQLite (embedded) or PostgreSQL (scale-out)."""

    def __init__(self, url: str) -> None:
        url = async_url(url)
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            # One connection: SQLite has one writer anyway, and serialising here avoids
            # "database is locked" retries under load.
            self.engine: AsyncEngine = create_async_engine(
                url, poolclass=AsyncAdaptedQueuePool, pool_size=1, max_overflow=0
            )
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            self.engine = create_async_engine(url, pool_size=10, max_overflow=10)

    async def init(self) -> None:
        """Bring the schema up to date (Alembic); safe when several processes start at once."""
        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                await conn.execute(text("SELECT pg_advisory_xact_lock(4242001)"))
            await conn.run_sync(upgrade)

    async def close(self) -> None:
        await self.engine.dispose()

    # ---- tenants ----------------------------------------------------------------------

    async def create_org(self, org: Org) -> None:
        async with self.engine.begin() as conn:
            try:
                await conn.execute(
                    insert(t.orgs).values(id=org.id, name=org.name, created_at=org.created_at)
                )
            except IntegrityError:
                raise Conflict(f"An organization named {org.name!r} already exists.") from None

    async def org_by_name(self, name: str) -> Org | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(t.orgs).where(t.orgs.c.name == name))).first()
        return Org(id=row.id, name=row.name, created_at=row.created_at) if row else None

    async def count_orgs(self) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(t.orgs))).scalar_one())

    async def create_api_key(self, key: ApiKey, secret_hash: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(t.api_keys).values(
                    id=key.id,
                    org_id=key.org_id,
                    prefix=key.prefix,
                    secret_hash=secret_hash,
                    scopes=",".join(sorted(key.scopes)),
                    created_at=int(time.time()),
                )
            )

    async def api_key_by_hash(self, secret_hash: str) -> ApiKey | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.api_keys).where(t.api_keys.c.secret_hash == secret_hash)
                )
            ).first()
        if row is None:
            return None
        return ApiKey(
            id=row.id, org_id=row.org_id, prefix=row.prefix, scopes=frozenset(row.scopes.split(","))
        )

    # ---- files ------------------------------------------------------------------------

    async def create_file(self, record: FileRecord) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(t.files).values(**_file_values(record)))

    async def get_file(self, org_id: str, file_id: str) -> FileRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.files).where(t.files.c.id == file_id, t.files.c.org_id == org_id)
                )
            ).first()
        return _file(row) if row else None

    async def list_files(
        self, org_id: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> Page:
        query = select(t.files).where(t.files.c.org_id == org_id, t.files.c.status != "deleted")
        if purpose:
            query = query.where(t.files.c.purpose == purpose)
        async with self.engine.connect() as conn:
            if after:
                anchor = (
                    await conn.execute(select(t.files.c.seq).where(t.files.c.id == after))
                ).scalar()
                if anchor is not None:
                    cond = t.files.c.seq > anchor if ascending else t.files.c.seq < anchor
                    query = query.where(cond)
            order = t.files.c.seq.asc() if ascending else t.files.c.seq.desc()
            rows = (await conn.execute(query.order_by(order).limit(limit + 1))).all()
        return Page(items=[_file(r) for r in rows[:limit]], has_more=len(rows) > limit)

    async def mark_file_deleted(self, file_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.files).where(t.files.c.id == file_id).values(status="deleted")
            )

    async def unfinished_batch_for_file(self, file_id: str) -> str | None:
        terminal = [
            s.value
            for s in (
                BatchStatus.COMPLETED,
                BatchStatus.FAILED,
                BatchStatus.EXPIRED,
                BatchStatus.CANCELLED,
            )
        ]
        async with self.engine.connect() as conn:
            return (
                await conn.execute(
                    select(t.batches.c.id)
                    .where(t.batches.c.input_file_id == file_id)
                    .where(t.batches.c.status.not_in(terminal))
                    .limit(1)
                )
            ).scalar()

    # ---- batches ----------------------------------------------------------------------

    async def create_batch(self, batch: BatchRecord) -> None:
        values = {k: getattr(batch, k) for k in _BATCH_FIELDS}
        values["seq"] = time.time_ns()
        async with self.engine.begin() as conn:
            try:
                await conn.execute(insert(t.batches).values(**values))
            except IntegrityError:
                raise Conflict(
                    "A batch with this Idempotency-Key was created concurrently; retry the "
                    "request to get it.",
                    code="idempotency_key_conflict",
                ) from None

    async def add_items(self, batch_id: str, lines: Sequence[LineRef]) -> None:
        for start in range(0, len(lines), _INSERT_CHUNK):
            chunk = lines[start : start + _INSERT_CHUNK]
            # Ignoring rows already there lets an interrupted creation be resumed.
            stmt = (
                insert(t.items).prefix_with("OR IGNORE")
                if self.is_sqlite
                else pg_insert(t.items).on_conflict_do_nothing()
            )
            async with self.engine.begin() as conn:
                await conn.execute(
                    stmt,
                    [
                        {
                            "batch_id": batch_id,
                            "idx": line.idx,
                            "offset": line.offset,
                            "length": line.length,
                            "custom_id": line.custom_id,
                            "state": ItemState.QUEUED,
                        }
                        for line in chunk
                    ],
                )

    async def get_batch(self, org_id: str | None, batch_id: str) -> BatchRecord | None:
        query = select(t.batches).where(t.batches.c.id == batch_id)
        if org_id is not None:
            query = query.where(t.batches.c.org_id == org_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return _batch(row) if row else None

    async def batch_by_idempotency_key(self, org_id: str, key: str) -> BatchRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.batches).where(
                        t.batches.c.org_id == org_id, t.batches.c.idempotency_key == key
                    )
                )
            ).first()
        return _batch(row) if row else None

    async def list_batches(self, org_id: str, after: str | None, limit: int) -> Page:
        query = select(t.batches).where(t.batches.c.org_id == org_id)
        async with self.engine.connect() as conn:
            if after:
                anchor = (
                    await conn.execute(select(t.batches.c.seq).where(t.batches.c.id == after))
                ).scalar()
                if anchor is not None:
                    query = query.where(t.batches.c.seq < anchor)
            rows = (
                await conn.execute(query.order_by(t.batches.c.seq.desc()).limit(limit + 1))
            ).all()
        return Page(items=[_batch(r) for r in rows[:limit]], has_more=len(rows) > limit)

    async def transition(
        self, batch_id: str, from_statuses: Sequence[str], to: str, now: int
    ) -> bool:
        values: dict[str, Any] = {"status": to}
        column = TIMESTAMP_OF.get(BatchStatus(to))
        if column:
            values[column] = now
        async with self.engine.begin() as conn:
            result = await conn.execute(
                update(t.batches)
                .where(t.batches.c.id == batch_id, t.batches.c.status.in_(list(from_statuses)))
                .values(**values)
            )
        return bool(result.rowcount)

    async def batches_in(self, statuses: Sequence[str]) -> list[BatchRecord]:
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(t.batches)
                    .where(t.batches.c.status.in_(list(statuses)))
                    .order_by(t.batches.c.expires_at)
                )
            ).all()
        return [_batch(r) for r in rows]

    # ---- work queue -------------------------------------------------------------------

    async def claim(
        self, batch_id: str, limit: int, token: str, lease_until: float, now: float
    ) -> list[ClaimedItem]:
        i = t.items
        claimable = and_(
            i.c.batch_id == batch_id,
            or_(
                i.c.state == ItemState.QUEUED,
                and_(i.c.state == ItemState.LEASED, i.c.lease_until < now),
            ),
        )
        pick = select(i.c.idx).where(claimable).order_by(i.c.idx).limit(limit)
        if not self.is_sqlite:
            pick = pick.with_for_update(skip_locked=True)
        stmt = (
            update(i)
            .where(i.c.batch_id == batch_id, i.c.idx.in_(pick.scalar_subquery()))
            .values(state=ItemState.LEASED, lease_token=token, lease_until=lease_until)
            .returning(i.c.idx, i.c.offset, i.c.length, i.c.custom_id)
        )
        async with self.engine.begin() as conn:
            rows = (await conn.execute(stmt)).all()
        return sorted(
            (ClaimedItem(batch_id, r.idx, r.offset, r.length, r.custom_id) for r in rows),
            key=lambda c: c.idx,
        )

    async def renew_leases(self, token: str, lease_until: float) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.items)
                .where(t.items.c.lease_token == token, t.items.c.state == ItemState.LEASED)
                .values(lease_until=lease_until)
            )

    async def release_all_leases(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.items)
                .where(t.items.c.state == ItemState.LEASED)
                .values(state=ItemState.QUEUED, lease_token=None, lease_until=None)
            )

    async def write_results(self, results: Sequence[ItemResult]) -> list[bool]:
        i = t.items
        accepted: dict[str, list[int]] = {}
        flags: list[bool] = []
        async with self.engine.begin() as conn:
            for r in results:
                res = await conn.execute(
                    update(i)
                    .where(
                        i.c.batch_id == r.batch_id,
                        i.c.idx == r.idx,
                        i.c.state == ItemState.LEASED,
                        i.c.lease_token == r.lease_token,
                    )
                    .values(
                        state=ItemState.DONE,
                        outcome=Outcome.OK if r.ok else Outcome.ERROR,
                        result=r.payload,
                        input_tokens=r.input_tokens,
                        output_tokens=r.output_tokens,
                        lease_token=None,
                        lease_until=None,
                    )
                )
                flags.append(bool(res.rowcount))
                if res.rowcount:
                    counts = accepted.setdefault(r.batch_id, [0, 0, 0, 0])
                    counts[0 if r.ok else 1] += 1
                    counts[2] += r.input_tokens
                    counts[3] += r.output_tokens
            for batch_id, (ok, bad, tin, tout) in accepted.items():
                await conn.execute(
                    update(t.batches)
                    .where(t.batches.c.id == batch_id)
                    .values(
                        completed=t.batches.c.completed + ok,
                        failed=t.batches.c.failed + bad,
                        input_tokens=t.batches.c.input_tokens + tin,
                        output_tokens=t.batches.c.output_tokens + tout,
                    )
                )
        return flags

    async def release(self, batch_id: str, idx: int, token: str) -> None:
        i = t.items
        async with self.engine.begin() as conn:
            await conn.execute(
                update(i)
                .where(
                    i.c.batch_id == batch_id,
                    i.c.idx == idx,
                    i.c.lease_token == token,
                    i.c.state == ItemState.LEASED,
                )
                .values(state=ItemState.QUEUED, lease_token=None, lease_until=None)
            )

    async def live_leases(self, batch_id: str, now: float) -> int:
        i = t.items
        async with self.engine.connect() as conn:
            return int(
                (
                    await conn.execute(
                        select(func.count())
                        .select_from(i)
                        .where(
                            i.c.batch_id == batch_id,
                            i.c.state == ItemState.LEASED,
                            i.c.lease_until >= now,
                        )
                    )
                ).scalar_one()
            )

    async def close_unfinished(self, batch_id: str, error_code: str) -> int:
        i = t.items
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(i)
                .where(i.c.batch_id == batch_id, i.c.state != ItemState.DONE)
                .values(
                    state=ItemState.DONE,
                    outcome=Outcome.ERROR,
                    error_code=error_code,
                    lease_token=None,
                    lease_until=None,
                )
            )
            closed = int(res.rowcount)
            if closed:
                await conn.execute(
                    update(t.batches)
                    .where(t.batches.c.id == batch_id)
                    .values(failed=t.batches.c.failed + closed)
                )
        return closed

    async def iter_results(self, batch_id: str) -> AsyncIterator[list[StoredResult]]:
        i = t.items
        last = -1
        while True:
            async with self.engine.connect() as conn:
                rows = (
                    await conn.execute(
                        select(i.c.idx, i.c.custom_id, i.c.outcome, i.c.result, i.c.error_code)
                        .where(i.c.batch_id == batch_id, i.c.idx > last)
                        .order_by(i.c.idx)
                        .limit(_RESULT_PAGE)
                    )
                ).all()
            if not rows:
                return
            last = rows[-1].idx
            yield [
                StoredResult(r.idx, r.custom_id, r.outcome == Outcome.OK, r.result, r.error_code)
                for r in rows
            ]

    async def publish(
        self,
        batch_id: str,
        expected_status: str,
        status: str,
        now: int,
        output: FileRecord,
        errors: FileRecord,
    ) -> bool:
        values: dict[str, Any] = {
            "status": status,
            "output_file_id": output.id,
            "error_file_id": errors.id,
        }
        column = TIMESTAMP_OF.get(BatchStatus(status))
        if column:
            values[column] = now
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(t.batches)
                .where(t.batches.c.id == batch_id, t.batches.c.status == expected_status)
                .values(**values)
            )
            if not res.rowcount:
                return False
            for record in (output, errors):
                await conn.execute(insert(t.files).values(**_file_values(record)))
        return True


def _file_values(record: FileRecord) -> dict[str, Any]:
    values = {k: getattr(record, k) for k in _FILE_FIELDS}
    values["seq"] = time.time_ns()
    return values


def async_url(url: str) -> str:
    """The async driver's URL for a plain ``postgresql://`` or ``sqlite://`` one."""
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return driver + url.removeprefix(plain)
    return url
