"""The hot path's statements on PostgreSQL with a million lines queued: ``EXPLAIN (ANALYZE,
BUFFERS)`` of the claim (its pick of chunks and its lease of lines) and of the result write
(the batch terms and the leases it locks, the stored result, the batch's counts), as the store
really runs them, values inlined.

    PYTHONPATH=. python -m bench.explain [--pg postgresql://postgres@127.0.0.1:5432/test]
        [--lines 1000000]

A fresh database is made and dropped again. The batch is written through the store's own
methods, as batch creation writes it (a row per line, a chunk per 256 lines, its lane), and is
left ``in_progress`` with every line queued. The lease and the writes run in one transaction
that is rolled back, so each statement sees the queue as it is under load. The plans are
printed whole; the summary says which index each statement used and whether any scanned a table.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Any

from sqlalchemy import Float, Integer, String, bindparam, text
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import result_writes
from backfill.adapters.db.claims import LANES_PER_CLAIM, lease_statement, pick_sql
from backfill.adapters.db.dialect import POSTGRES
from backfill.adapters.db.store import SqlStore
from backfill.domain.chunks import Chunker
from backfill.domain.files import FilePurpose, FileRecord, FileStatus
from backfill.domain.lifecycle import BatchStatus, Outcome
from backfill.domain.lines import LineRef
from backfill.domain.records import Admission, BatchRecord, Org
from bench.scale_workers import drop_database, fresh_database

NOW = 1_000_000.0
MODEL = "bench-model"
TOKEN = "bench-token"
ADMIT_ALL = Admission(
    reserve=0,
    require_positive_balance=False,
    max_unfinished=1000,
    max_retained_input_bytes=1 << 40,
    throughput_tokens_per_s=None,
)


async def queued_batch(store: SqlStore, lines: int) -> BatchRecord:
    org = Org(id="org_bench", name="bench", created_at=int(NOW))
    await store.create_org(org)
    source = FileRecord(
        id="file-bench",
        org_id=org.id,
        purpose=FilePurpose.BATCH,
        filename="bench.jsonl",
        bytes=lines * 100,
        created_at=int(NOW),
        expires_at=int(NOW) + 86400,
        status=FileStatus.PROCESSED,
    )
    await store.create_file(source)
    batch = BatchRecord(
        id="batch_bench",
        org_id=org.id,
        endpoint="/v1/chat/completions",
        model=MODEL,
        model_config_id="bench-v1",
        input_file_id=source.id,
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=int(NOW),
        expires_at=int(NOW) + 86400,
        total=lines,
    )
    await store.create_batch(batch, ADMIT_ALL)
    chunker = Chunker()
    step = 50_000
    for start in range(0, lines, step):
        refs = [
            LineRef(i, i * 100, 100, f"req-{i}") for i in range(start, min(lines, start + step))
        ]
        await store.add_items(batch.id, list(chunker.feed(refs)))
    await store.add_items(batch.id, list(chunker.close()))
    assert await store.transition(batch.id, [BatchStatus.VALIDATING], "in_progress", 1)
    return batch


async def explain(
    conn: AsyncConnection, title: str, statement: Any, values: dict[str, Any] | None = None
) -> str:
    """The plan of ``statement``: a query with its values inlined, or an UPDATE run with
    ``values`` (which cannot be inlined there), compiled as the store's is and its parameters
    sent by position."""
    if values is None:
        inlined = statement.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
        sql, sent = str(inlined), ()
    else:
        compiled = statement.compile(dialect=conn.dialect)
        given = compiled.construct_params(values)
        sql, sent = str(compiled), tuple(given[name] for name in compiled.positiontup or ())
    rows = await conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql, sent)
    plan = "\n".join(str(row[0]) for row in rows)
    indexes = sorted(set(re.findall(r"(?:using|Index Scan on) (\w+)", plan)))
    seq = sorted(set(re.findall(r"Seq Scan on (\w+)", plan)))
    scans = f"sequential scans of {', '.join(seq)}" if seq else "no sequential scan"
    took = re.search(r"Execution Time: ([\d.]+) ms", plan)
    summary = f"{title}: {', '.join(indexes) or 'no index'}; {scans}; "
    summary += f"{took.group(1)} ms" if took else "time unknown"
    print(f"\n== {title}\n{plan}")
    return summary


async def run(admin_url: str, lines: int) -> None:
    url = await fresh_database(admin_url)
    store = SqlStore(url)
    try:
        await store.init()
        started = time.perf_counter()
        batch = await queued_batch(store, lines)
        print(f"{lines:,} lines queued in {time.perf_counter() - started:.1f} s")
        summaries = []
        async with store.engine.connect() as conn:
            await conn.execute(text("ANALYZE"))
            await conn.commit()
            pick = text(pick_sql(POSTGRES)).bindparams(
                bindparam("models", [MODEL], expanding=True, type_=String()),
                bindparam("now", NOW, type_=Float()),
                bindparam("k", LANES_PER_CLAIM, type_=Integer()),
                bindparam("lanes", 4 * LANES_PER_CLAIM, type_=Integer()),
            )
            summaries.append(await explain(conn, "claim: pick a chunk per lane", pick))
            lease = {
                "batch": batch.id,
                "first": 0,
                "end": 256,
                "now": NOW,
                "limit": 256,
                "token": TOKEN,
                "until": NOW + 60,
            }
            summaries.append(
                await explain(
                    conn, "claim: lease the chunk's lines", lease_statement(POSTGRES), lease
                )
            )
            idxs = list(range(0, 64))
            terms = result_writes.batch_terms(POSTGRES).params(ids=[batch.id])
            summaries.append(await explain(conn, "write: lock the batch's terms", terms))
            held = result_writes.locked_leases(POSTGRES).params(batch=batch.id, idxs=idxs)
            summaries.append(await explain(conn, "write: lock 64 leases", held))
            store_one = dict(
                b_batch=batch.id,
                b_idx=0,
                b_outcome=Outcome.OK,
                b_result=b"sealed",
                b_seq=1,
                b_at=NOW,
                b_in=10,
                b_out=20,
            )
            summaries.append(
                await explain(conn, "write: store a result", result_writes.STORE_RESULT, store_one)
            )
            counts = dict(
                batch=batch.id,
                d_completed=64,
                d_failed=0,
                d_input=640,
                d_output=1280,
                d_cached=0,
                d_charged=0,
                d_released=0,
                d_numbered=64,
            )
            summaries.append(
                await explain(conn, "write: count the results", result_writes.COUNT_RESULTS, counts)
            )
            await conn.rollback()
        print(f"\n{lines:,} queued lines, PostgreSQL:")
        for line in summaries:
            print("  " + line)
    finally:
        await store.close()
        await drop_database(admin_url, url)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    asyncio.run(run(args.pg, args.lines))


if __name__ == "__main__":
    main()
