"""``Store`` over SQLAlchemy Core: the one place with SQL and dialect differences."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import fields
from typing import Any

from sqlalchemy import and_, bindparam, event, func, insert, or_, select, text, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from backfill.adapters.db import tables as t
from backfill.adapters.db.migrate import upgrade
from backfill.domain.catalog import CatalogModel
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState, Outcome
from backfill.domain.money import Prices, pico_to_usd, token_charge
from backfill.errors import Conflict, PaymentRequired, RateLimited
from backfill.ports import (
    Admission,
    ApiKey,
    BatchRecord,
    ClaimedItem,
    FileRecord,
    ItemResult,
    Ledger,
    LineRef,
    Org,
    Page,
    Receipt,
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


_TERMINAL = [
    BatchStatus.COMPLETED.value,
    BatchStatus.FAILED.value,
    BatchStatus.EXPIRED.value,
    BatchStatus.CANCELLED.value,
]


def _prices(row: Any) -> Prices | None:
    """Prices stored in a row's price_* columns, or None where the row has none."""
    if row.price_input is None or row.price_output is None:
        return None
    return Prices(row.price_input, row.price_cached_input or 0, row.price_output)


def _model(row: Any) -> CatalogModel:
    return CatalogModel(
        id=row.id,
        model_config_id=row.model_config_id,
        context_length=row.context_length,
        max_output_tokens=row.max_output_tokens,
        modalities=frozenset(row.modalities.split(",")),
        prices=_prices(row),
        owner_org_id=row.owner_org_id,
        gpu_count=row.gpu_count,
        microusd_per_gpu_second=row.microusd_per_gpu_second,
        throughput_tokens_per_s=row.throughput_tokens_per_s,
    )


class _Settling:
    """Charges of one batch within a result write: receipts, then one update per row."""

    def __init__(self, row: Any) -> None:
        self.id: str = row.id
        self.org_id: str = row.org_id
        self.model_config_id: str = row.model_config_id
        self.reserved: int = row.reserved
        self.prices = _prices(row) if row.billing == "catalog" else None
        self.ok = self.failed = self.tokens_in = self.tokens_out = self.cached = 0
        self.charged = 0

    def add(self, r: ItemResult, now: float) -> dict[str, Any] | None:
        if not r.ok:
            self.failed += 1
            return None
        self.ok += 1
        self.tokens_in += r.input_tokens
        self.tokens_out += r.output_tokens
        self.cached += r.cached_tokens
        if self.prices is None or r.request_id is None:
            return None
        amount = token_charge(self.prices, r.input_tokens, r.cached_tokens, r.output_tokens)
        self.charged += amount
        return {
            "request_id": r.request_id,
            "org_id": self.org_id,
            "kind": "tokens",
            "batch_id": self.id,
            "idx": r.idx,
            "custom_id": r.custom_id,
            "model_config_id": self.model_config_id,
            "input_tokens": r.input_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": r.output_tokens,
            "price_input": self.prices.input,
            "price_cached_input": self.prices.cached_input,
            "price_output": self.prices.output,
            "amount": amount,
            "created_at": now,
        }

    async def apply(self, conn: AsyncConnection) -> None:
        if not (self.ok or self.failed):
            return
        b = t.batches
        release = min(self.charged, self.reserved)
        await conn.execute(
            update(b)
            .where(b.c.id == self.id)
            .values(
                completed=b.c.completed + self.ok,
                failed=b.c.failed + self.failed,
                input_tokens=b.c.input_tokens + self.tokens_in,
                output_tokens=b.c.output_tokens + self.tokens_out,
                cached_tokens=b.c.cached_tokens + self.cached,
                charged=b.c.charged + self.charged,
                reserved=b.c.reserved - release,
            )
        )
        if self.charged:
            o = t.orgs
            await conn.execute(
                update(o)
                .where(o.c.id == self.org_id)
                .values(balance=o.c.balance - self.charged, reserved=o.c.reserved - release)
            )


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

    # ---- catalog ----------------------------------------------------------------------

    async def list_models(self) -> list[CatalogModel]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(t.models).order_by(t.models.c.id))).all()
        return [_model(r) for r in rows]

    async def upsert_model(self, model: CatalogModel, now: int, *, replace: bool) -> None:
        prices = model.prices
        values: dict[str, Any] = {
            "model_config_id": model.model_config_id,
            "context_length": model.context_length,
            "max_output_tokens": model.max_output_tokens,
            "modalities": ",".join(sorted(model.modalities)),
            "price_input": prices.input if prices else None,
            "price_cached_input": prices.cached_input if prices else None,
            "price_output": prices.output if prices else None,
            "owner_org_id": model.owner_org_id,
            "gpu_count": model.gpu_count,
            "microusd_per_gpu_second": model.microusd_per_gpu_second,
            "throughput_tokens_per_s": model.throughput_tokens_per_s,
            "updated_at": now,
        }
        async with self.engine.begin() as conn:
            exists = (
                await conn.execute(select(t.models.c.id).where(t.models.c.id == model.id))
            ).first()
            if exists is None:
                await conn.execute(insert(t.models).values(id=model.id, **values))
            elif replace:
                await conn.execute(
                    update(t.models).where(t.models.c.id == model.id).values(**values)
                )

    # ---- billing ----------------------------------------------------------------------

    async def add_credit(self, org_id: str, amount: int, note: str | None, now: int) -> int:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(t.credits).values(
                    id=f"cr_{uuid.uuid4().hex}",
                    org_id=org_id,
                    amount=amount,
                    note=note,
                    created_at=now,
                )
            )
            await conn.execute(
                update(t.orgs)
                .where(t.orgs.c.id == org_id)
                .values(balance=t.orgs.c.balance + amount)
            )
            balance = (
                await conn.execute(select(t.orgs.c.balance).where(t.orgs.c.id == org_id))
            ).scalar_one()
        return int(balance)

    async def ledger(self, org_id: str) -> Ledger:
        async with self.engine.connect() as conn:
            credits = (
                await conn.execute(
                    select(func.coalesce(func.sum(t.credits.c.amount), 0)).where(
                        t.credits.c.org_id == org_id
                    )
                )
            ).scalar_one()
            charges, receipts = (
                await conn.execute(
                    select(func.coalesce(func.sum(t.receipts.c.amount), 0), func.count()).where(
                        t.receipts.c.org_id == org_id
                    )
                )
            ).one()
            org = (
                await conn.execute(
                    select(t.orgs.c.balance, t.orgs.c.reserved).where(t.orgs.c.id == org_id)
                )
            ).one()
        return Ledger(
            int(credits), int(charges), int(org.balance), int(org.reserved), int(receipts)
        )

    async def balances(self, org_ids: Sequence[str]) -> dict[str, int]:
        if not org_ids:
            return {}
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(t.orgs.c.id, t.orgs.c.balance).where(t.orgs.c.id.in_(list(org_ids)))
                )
            ).all()
        return {r.id: int(r.balance) for r in rows}

    async def get_receipt(self, org_id: str, request_id: str) -> Receipt | None:
        r = t.receipts
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(r).where(r.c.request_id == request_id, r.c.org_id == org_id)
                )
            ).first()
        if row is None:
            return None
        return Receipt(
            request_id=row.request_id,
            org_id=row.org_id,
            kind=row.kind,
            batch_id=row.batch_id,
            custom_id=row.custom_id,
            model_config_id=row.model_config_id,
            deployment_id=row.deployment_id,
            input_tokens=row.input_tokens,
            cached_tokens=row.cached_tokens,
            output_tokens=row.output_tokens,
            prices=_prices(row),
            gpu_count=row.gpu_count,
            gpu_ms=row.gpu_ms,
            amount=row.amount,
            started_at=row.started_at,
            created_at=row.created_at,
        )

    async def charge_gpu_time(self, receipt: Receipt) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(t.receipts).values(
                    request_id=receipt.request_id,
                    org_id=receipt.org_id,
                    kind=receipt.kind,
                    deployment_id=receipt.deployment_id,
                    model_config_id=receipt.model_config_id,
                    gpu_count=receipt.gpu_count,
                    gpu_ms=receipt.gpu_ms,
                    amount=receipt.amount,
                    started_at=receipt.started_at,
                    created_at=receipt.created_at,
                )
            )
            await conn.execute(
                update(t.orgs)
                .where(t.orgs.c.id == receipt.org_id)
                .values(balance=t.orgs.c.balance - receipt.amount)
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

    async def expired_files(self, now: int, limit: int) -> list[FileRecord]:
        f, b = t.files, t.batches
        busy = select(b.c.input_file_id).where(b.c.status.not_in(_TERMINAL))
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(f)
                    .where(
                        f.c.status != "deleted",
                        f.c.expires_at <= now,
                        f.c.id.not_in(busy),
                    )
                    .order_by(f.c.expires_at)
                    .limit(limit)
                )
            ).all()
        return [_file(r) for r in rows]

    async def set_file_expiry(self, file_id: str, expires_at: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.files).where(t.files.c.id == file_id).values(expires_at=expires_at)
            )

    async def purge_results(self, batch_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.items).where(t.items.c.batch_id == batch_id).values(result=None)
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

    async def create_batch(self, batch: BatchRecord, admission: Admission) -> None:
        values = {k: getattr(batch, k) for k in _BATCH_FIELDS}
        values["seq"] = time.time_ns()
        values["reserved"] = admission.reserve
        o = t.orgs
        async with self.engine.begin() as conn:
            # The org row's lock (PostgreSQL; SQLite has one writer) orders concurrent creations
            # of one org: each sees the ones before it, so none overspends, and a replay of an
            # idempotency key finds the original instead of being refused for its credit.
            if not self.is_sqlite:
                await conn.execute(select(o.c.id).where(o.c.id == batch.org_id).with_for_update())
            if batch.idempotency_key is not None:
                b = t.batches
                taken = await conn.execute(
                    select(b.c.id).where(
                        b.c.org_id == batch.org_id, b.c.idempotency_key == batch.idempotency_key
                    )
                )
                if taken.first() is not None:
                    raise Conflict(
                        "A batch with this Idempotency-Key already exists.",
                        code="idempotency_key_conflict",
                    )
            reserved = await conn.execute(
                update(o)
                .where(o.c.id == batch.org_id, o.c.balance - o.c.reserved >= admission.reserve)
                .where(o.c.balance > 0 if admission.require_positive_balance else true())
                .values(reserved=o.c.reserved + admission.reserve)
            )
            if not reserved.rowcount:
                await self._refuse_credit(conn, batch.org_id, admission)
            await self._check_limits(conn, batch, admission)
            try:
                await conn.execute(insert(t.batches).values(**values))
            except IntegrityError:
                raise Conflict(
                    "A batch with this Idempotency-Key was created concurrently; retry the "
                    "request to get it.",
                    code="idempotency_key_conflict",
                ) from None

    async def _refuse_credit(
        self, conn: AsyncConnection, org_id: str, admission: Admission
    ) -> None:
        row = (
            await conn.execute(
                select(t.orgs.c.balance, t.orgs.c.reserved).where(t.orgs.c.id == org_id)
            )
        ).one()
        available = row.balance - row.reserved
        if admission.require_positive_balance:
            raise PaymentRequired(
                f"Batches on a private deployment need a positive balance (it is "
                f"{pico_to_usd(row.balance)} USD); add credit and retry."
            )
        raise PaymentRequired(
            f"This batch needs {pico_to_usd(admission.reserve)} USD of credit for its worst case "
            f"but {pico_to_usd(available)} USD is available; add credit or submit fewer requests. "
            "Nothing was queued and the input file can be used again."
        )

    async def _check_limits(
        self, conn: AsyncConnection, batch: BatchRecord, admission: Admission
    ) -> None:
        b = t.batches
        unfinished = (
            await conn.execute(
                select(func.count())
                .select_from(b)
                .where(b.c.org_id == batch.org_id, b.c.status.not_in(_TERMINAL))
            )
        ).scalar_one()
        if unfinished >= admission.max_unfinished:
            raise RateLimited(
                f"This organization already has {unfinished} unfinished batches (the limit is "
                f"{admission.max_unfinished}); wait for one to finish or cancel one, then retry.",
                code="too_many_unfinished_batches",
                retry_after_s=60,
            )
        f = t.files
        retained = (
            await conn.execute(
                select(func.coalesce(func.sum(f.c.bytes), 0)).where(
                    f.c.org_id == batch.org_id, f.c.purpose == "batch", f.c.status != "deleted"
                )
            )
        ).scalar_one()
        if retained > admission.max_retained_input_bytes:
            raise RateLimited(
                f"This organization keeps {retained} bytes of input files (the limit is "
                f"{admission.max_retained_input_bytes}); delete input files you no longer need "
                "(DELETE /v1/files/{id}) and retry.",
                code="retained_input_limit",
            )
        if admission.throughput_tokens_per_s:
            await self._check_capacity(conn, batch, admission.throughput_tokens_per_s)

    async def _check_capacity(self, conn: AsyncConnection, batch: BatchRecord, rate: int) -> None:
        b = t.batches
        rows = (
            await conn.execute(
                select(b.c.output_token_bound, b.c.total, b.c.completed, b.c.failed).where(
                    b.c.model == batch.model, b.c.status.not_in(_TERMINAL)
                )
            )
        ).all()
        queued = sum(
            r.output_token_bound * (r.total - r.completed - r.failed) // max(r.total, 1)
            for r in rows
        )
        window = batch.expires_at - batch.created_at
        if queued + batch.output_token_bound > rate * window:
            wait = -(-(queued + batch.output_token_bound - rate * window) // rate)
            raise RateLimited(
                f"{batch.model} has {queued} output tokens queued; with this batch's "
                f"{batch.output_token_bound} it cannot finish inside the {batch.completion_window} "
                f"window at {rate} tokens/s. Retry in about {wait}s, use a longer window, or split "
                "the file.",
                code="capacity_exceeded",
                retry_after_s=int(wait),
            )

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
        running = (
            select(t.batches.c.id)
            .where(t.batches.c.id == batch_id, t.batches.c.status == BatchStatus.IN_PROGRESS)
            .exists()
        )
        claimable = and_(
            i.c.batch_id == batch_id,
            or_(
                i.c.state == ItemState.QUEUED,
                and_(i.c.state == ItemState.LEASED, i.c.lease_until < now),
            ),
            running,
        )
        pick = select(i.c.idx).where(claimable).order_by(i.c.idx).limit(limit)
        values = {"state": ItemState.LEASED, "lease_token": token, "lease_until": lease_until}
        returning = (i.c.idx, i.c.offset, i.c.length, i.c.custom_id)
        if self.is_sqlite:
            stmt = (
                update(i)
                .where(i.c.batch_id == batch_id, i.c.idx.in_(pick.scalar_subquery()))
                .values(**values)
                .returning(*returning)
            )
        else:
            # A CTE runs once; an IN-subquery may be re-run per row and claim past the limit.
            picked = pick.with_for_update(skip_locked=True).cte("picked")
            stmt = (
                update(i)
                .where(i.c.batch_id == batch_id, i.c.idx == picked.c.idx)
                .values(**values)
                .returning(*returning)
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
        b = t.batches
        now = time.time()
        async with self.engine.begin() as conn:
            batch_ids = sorted({r.batch_id for r in results})
            query = select(
                b.c.id,
                b.c.org_id,
                b.c.billing,
                b.c.model_config_id,
                b.c.reserved,
                b.c.price_input,
                b.c.price_cached_input,
                b.c.price_output,
            ).where(b.c.id.in_(batch_ids))
            if not self.is_sqlite:
                query = query.with_for_update()
            batches = {row.id: _Settling(row) for row in (await conn.execute(query)).all()}
            held = await self._held_leases(conn, results)
            flags = []
            for r in results:
                key = (r.batch_id, r.idx, r.lease_token)
                flags.append(key in held)
                held.discard(key)  # a second result for the same item in one write loses
            accepted = [r for r, ok in zip(results, flags, strict=True) if ok]
            if accepted:
                # The leases were just checked (and locked on PostgreSQL) in this transaction,
                # so one executemany stores them all.
                await conn.execute(
                    update(i)
                    .where(i.c.batch_id == bindparam("b_batch"), i.c.idx == bindparam("b_idx"))
                    .values(
                        state=ItemState.DONE,
                        outcome=bindparam("b_outcome"),
                        result=bindparam("b_result"),
                        input_tokens=bindparam("b_in"),
                        output_tokens=bindparam("b_out"),
                        lease_token=None,
                        lease_until=None,
                    ),
                    [
                        {
                            "b_batch": r.batch_id,
                            "b_idx": r.idx,
                            "b_outcome": Outcome.OK if r.ok else Outcome.ERROR,
                            "b_result": r.payload,
                            "b_in": r.input_tokens,
                            "b_out": r.output_tokens,
                        }
                        for r in accepted
                    ],
                )
                receipts = [
                    receipt
                    for r in accepted
                    if (receipt := batches[r.batch_id].add(r, now)) is not None
                ]
                if receipts:
                    await conn.execute(insert(t.receipts), receipts)
            for settling in batches.values():
                await settling.apply(conn)
        return flags

    async def _held_leases(
        self, conn: AsyncConnection, results: Sequence[ItemResult]
    ) -> set[tuple[str, int, str]]:
        """Which of these results' items are still leased with the token they carry."""
        i = t.items
        held: set[tuple[str, int, str]] = set()
        by_batch: dict[str, list[int]] = {}
        for r in results:
            by_batch.setdefault(r.batch_id, []).append(r.idx)
        for batch_id, idxs in by_batch.items():
            query = select(i.c.idx, i.c.lease_token).where(
                i.c.batch_id == batch_id, i.c.idx.in_(idxs), i.c.state == ItemState.LEASED
            )
            if not self.is_sqlite:
                query = query.with_for_update()
            for row in (await conn.execute(query)).all():
                held.add((batch_id, row.idx, row.lease_token))
        return held

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
            await self._release_reservation(conn, batch_id)
            # Accepted input is removed once its batch is over (SPEC §10.3): the janitor takes
            # it unless another unfinished batch still reads it.
            input_id = select(t.batches.c.input_file_id).where(t.batches.c.id == batch_id)
            await conn.execute(
                update(t.files)
                .where(t.files.c.id == input_id.scalar_subquery())
                .values(
                    expires_at=func.min(t.files.c.expires_at, now)
                    if self.is_sqlite
                    else func.least(t.files.c.expires_at, now)
                )
            )
        return True

    async def _release_reservation(self, conn: AsyncConnection, batch_id: str) -> None:
        """At the terminal state the unspent part of the reservation goes back (SPEC §7.3)."""
        b = t.batches
        row = (await conn.execute(select(b.c.org_id, b.c.reserved).where(b.c.id == batch_id))).one()
        if row.reserved:
            await conn.execute(update(b).where(b.c.id == batch_id).values(reserved=0))
            await conn.execute(
                update(t.orgs)
                .where(t.orgs.c.id == row.org_id)
                .values(reserved=t.orgs.c.reserved - row.reserved)
            )


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
