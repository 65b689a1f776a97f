"""Rows as records (and records as rows), and the few helpers the query mixins share."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

from sqlalchemy import Table, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.spend_caps import settle_spend
from backfill.domain import ids, lifecycle
from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.files import FilePurpose, FileRecord, FileStatus, InputFormat
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import Prices
from backfill.domain.records import BatchRecord, Org, Receipt, ReceiptKind
from backfill.errors import InvalidInput

# What a batch row holds: every field of the record but those derived when it is read.
BATCH_FIELDS = [f.name for f in fields(BatchRecord) if f.metadata.get("stored", True)]
FILE_FIELDS = [f.name for f in fields(FileRecord)]

# The terminal statuses as plain strings, for SQL ``IN`` clauses.
TERMINAL = sorted(status.value for status in lifecycle.TERMINAL)
# The others: a positive list, which an index on ``status`` can serve (``NOT IN`` cannot).
UNFINISHED = sorted(
    status.value for status in lifecycle.BatchStatus if status not in lifecycle.TERMINAL
)


def prices_of(row: Any) -> Prices | None:
    """Prices stored in a row's price_* columns, or None where the row has none."""
    return Prices.stored(row.price_input, row.price_cached_input, row.price_output)


def model_of(row: Any, aliases: frozenset[str] = frozenset()) -> CatalogModel:
    """The entry a ``models`` row holds, with the aliases ``model_names`` holds for it."""
    return CatalogModel(
        id=row.id,
        model_config_id=row.model_config_id,
        context_length=row.context_length,
        max_output_tokens=row.max_output_tokens,
        modalities=frozenset(row.modalities.split(",")),
        prices=prices_of(row),
        owner_org_id=row.owner_org_id,
        gpu_count=row.gpu_count,
        microusd_per_gpu_second=row.microusd_per_gpu_second,
        throughput_tokens_per_s=row.throughput_tokens_per_s,
        endpoints=frozenset(row.endpoints.split(",")),
        aliases=aliases,
    )


def org_of(row: Any) -> Org:
    return Org(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        weight=row.weight,
        max_priority=row.max_priority,
    )


def batch_of(row: Any) -> BatchRecord:
    data = dict(row._mapping)
    record = BatchRecord(**{k: data[k] for k in BATCH_FIELDS})
    record.status = BatchStatus(record.status)
    record.billing = Billing(record.billing)
    return record


def file_of(row: Any) -> FileRecord:
    data = dict(row._mapping)
    record = FileRecord(**{k: data[k] for k in FILE_FIELDS})
    record.purpose = FilePurpose(record.purpose)
    record.status = FileStatus(record.status)
    record.input_format = InputFormat(record.input_format)
    return record


def file_values(record: FileRecord) -> dict[str, Any]:
    values = {k: getattr(record, k) for k in FILE_FIELDS}
    values["seq"] = listing_key()
    return values


def batch_values(record: BatchRecord) -> dict[str, Any]:
    values = {k: getattr(record, k) for k in BATCH_FIELDS}
    values["seq"] = listing_key()
    return values


def listing_key() -> int:
    """A new row's ``seq``: the inserting process's wall clock in nanoseconds, which listings
    sort and page by. Not a sequence: rows inserted by processes whose clocks disagree list
    in their clocks' order."""
    return time.time_ns()


RECEIPT_COLUMNS = (
    "request_id",
    "org_id",
    "kind",
    "batch_id",
    "idx",
    "custom_id",
    "model_config_id",
    "deployment_id",
    "input_tokens",
    "cached_tokens",
    "output_tokens",
    "price_input",
    "price_cached_input",
    "price_output",
    "gpu_count",
    "gpu_ms",
    "amount",
    "started_at",
    "created_at",
)


def receipt_row(receipt: Receipt) -> tuple[Any, ...]:
    """A receipt as the driver takes its row, in ``RECEIPT_COLUMNS`` order: the prices of a
    token receipt, the GPU time of a GPU-time receipt, NULL where the other kind's go."""
    prices = receipt.prices
    gpu = receipt.kind == ReceiptKind.GPU_TIME
    return (
        receipt.request_id,
        receipt.org_id,
        receipt.kind.value,
        receipt.batch_id,
        receipt.idx,
        receipt.custom_id,
        receipt.model_config_id,
        receipt.deployment_id if gpu else None,
        receipt.input_tokens,
        receipt.cached_tokens,
        receipt.output_tokens,
        None if prices is None else prices.input,
        None if prices is None else prices.cached_input,
        None if prices is None else prices.output,
        receipt.gpu_count if gpu else None,
        receipt.gpu_ms if gpu else None,
        receipt.amount,
        receipt.started_at if gpu else None,
        receipt.created_at,
    )


def receipt_values(receipt: Receipt) -> dict[str, Any]:
    """A receipt as its row, by column."""
    return dict(zip(RECEIPT_COLUMNS, receipt_row(receipt), strict=True))


def receipt_of(row: Any) -> Receipt:
    return Receipt(
        request_id=row.request_id,
        org_id=row.org_id,
        kind=ReceiptKind(row.kind),
        batch_id=row.batch_id,
        custom_id=row.custom_id,
        model_config_id=row.model_config_id,
        deployment_id=row.deployment_id,
        input_tokens=row.input_tokens,
        cached_tokens=row.cached_tokens,
        output_tokens=row.output_tokens,
        prices=prices_of(row),
        gpu_count=row.gpu_count,
        gpu_ms=row.gpu_ms,
        amount=row.amount,
        started_at=row.started_at,
        created_at=row.created_at,
        idx=row.idx,
    )


async def lock_org(conn: AsyncConnection, dialect: Dialect, org_id: str) -> None:
    """Hold the org row until the transaction ends (PostgreSQL; SQLite has one writer): what
    admits new work for the org is decided one transaction at a time."""
    o = t.orgs
    await dialect.lock(conn, select(o.c.id).where(o.c.id == org_id))


async def listing_anchor(
    conn: AsyncConnection, table: Table, org_id: str, after: str, kind: str
) -> int:
    """The ``seq`` of the org's row ``after`` names: where the next page of a listing starts."""
    anchor = (
        (
            await conn.execute(
                select(table.c.seq).where(table.c.id == after, table.c.org_id == org_id)
            )
        ).scalar()
        if ids.plausible(after)
        else None
    )
    if anchor is None:
        # The same answer for an id of another org as for one that never existed.
        raise InvalidInput(
            f"'after' must be the id of a {kind} of this organization from an earlier page; "
            f"{after[: ids.MAX_ID_CHARS]!r} is not one.",
            code="invalid_value",
            param="after",
        )
    return int(anchor)


async def release_reservation(conn: AsyncConnection, batch_id: str) -> None:
    """At the terminal state the unspent part of the reservation goes back (SPEC §7.3), and
    the batch counts under spend caps for what it was charged."""
    b = t.batches
    row = (
        await conn.execute(select(b.c.org_id, b.c.reserved, b.c.charged).where(b.c.id == batch_id))
    ).one()
    await settle_spend(conn, batch_id, int(row.charged))
    if row.reserved:
        await conn.execute(update(b).where(b.c.id == batch_id).values(reserved=0))
        await conn.execute(
            update(t.orgs)
            .where(t.orgs.c.id == row.org_id)
            .values(reserved=t.orgs.c.reserved - row.reserved)
        )
