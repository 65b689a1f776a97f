"""Rows as records, and the few column lists and constants the queries share."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.domain import lifecycle
from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.files import FilePurpose, FileStatus
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import Prices
from backfill.domain.records import BatchRecord, FileRecord

BATCH_FIELDS = [f.name for f in fields(BatchRecord)]
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


def model_of(row: Any) -> CatalogModel:
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
    return record


def file_values(record: FileRecord) -> dict[str, Any]:
    values = {k: getattr(record, k) for k in FILE_FIELDS}
    values["seq"] = time.time_ns()
    return values


async def release_reservation(conn: AsyncConnection, batch_id: str) -> None:
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
