"""One SQLite statement's CPU: Backfill's connections (one trip to aiosqlite's thread per
statement) against SQLAlchemy's stock aiosqlite adapter (three or four), same database.

    PYTHONPATH=. python -m bench.statements             # 3,000 statements, 4 rounds

Each round reads one row by key ``--statements`` times on one connection, then updates 20
rows with one ``executemany`` ``--statements // 10`` times, on each side in turn (the order
alternating between rounds); the figures are the process's CPU per statement, best of the
rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from backfill.adapters.db.dialect import SQLITE
from bench.common import own_cpu


async def measure(engine: AsyncEngine, statements: int) -> tuple[float, float]:
    """(CPU ms per single-row SELECT, per 20-row executemany UPDATE)."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)"))
        await conn.execute(text("DELETE FROM t"))
        rows = [{"i": i, "v": str(i)} for i in range(1000)]
        await conn.execute(text("INSERT INTO t VALUES (:i, :v)"), rows)
    read = text("SELECT v FROM t WHERE id = :i")
    write = text("UPDATE t SET v = :v WHERE id = :i")
    async with engine.connect() as conn:
        before = own_cpu()
        for i in range(statements):
            (await conn.execute(read, {"i": i % 1000})).all()
        reads = own_cpu() - before
        before = own_cpu()
        for n in range(statements // 10):
            await conn.execute(write, [{"i": i, "v": f"{n}"} for i in range(20)])
        writes = own_cpu() - before
        await conn.commit()
    await engine.dispose()
    return reads / statements * 1000, writes / (statements // 10) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    best: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("stock", "backfill") if r % 2 == 0 else ("backfill", "stock"):
                url = f"sqlite+aiosqlite:///{Path(tmp) / side}.db"
                engine = (
                    SQLITE.engine(url)
                    if side == "backfill"
                    else create_async_engine(url, poolclass=AsyncAdaptedQueuePool, pool_size=1)
                )
                got = asyncio.run(measure(engine, args.statements))
                old = best.get(side, got)
                best[side] = (min(old[0], got[0]), min(old[1], got[1]))
    print(f"{args.statements} statements, {args.rounds} rounds (best)")
    for side, label in (("stock", "SQLAlchemy's aiosqlite adapter"), ("backfill", "one trip")):
        read, write = best[side]
        print(f"{label:<31}: SELECT {read:.3f} ms  executemany(20) {write:.3f} ms of CPU")
    print(
        f"one trip / stock: SELECT {best['backfill'][0] / best['stock'][0]:.2f}x, "
        f"executemany {best['backfill'][1] / best['stock'][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
