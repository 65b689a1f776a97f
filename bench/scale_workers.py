"""Drain throughput on PostgreSQL with 1, 2 and 3 worker processes (SPEC §2 scale-out), and
what each request line costs the PostgreSQL primary.

    PYTHONPATH=. python -m bench.scale_workers [--requests 6000] [--workers 1,2,3]
        [--pg postgresql://postgres@127.0.0.1:5432/test]

One API process and N workers share a fresh PostgreSQL database and one storage directory.
The simulated engine answers in ~5 ms with no concurrency cap, so the engine is not the
bottleneck; each worker may hold 64 requests in flight. The baseline is the first worker count
(one worker by default).

From just before the batch is created until it completes, each run also measures, per request
line drained: the CPU time of every process of the PostgreSQL server, the WAL it wrote, the CPU
time of the Backfill processes (the API and the workers), and afterwards the churn on ``items``
(dead tuples, updates and how many of them were HOT). The server's CPU can only be read when it
runs on this machine, in the same process namespace; otherwise it is reported as n/a. CPU and
WAL are server-wide: anything else using the server meanwhile is counted too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.common import (
    cpu_seconds,
    create_batch,
    free_port,
    request_line,
    sim_config,
    start_simulator,
    stop,
    upload,
    wait_batch,
    wait_http,
)


async def fresh_database(admin_url: str) -> str:
    name = f"bf_bench_{os.urandom(4).hex()}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


async def drop_database(admin_url: str, url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await conn.close()


def write_config(path: Path, db: str, storage: Path, sim_url: str) -> None:
    key = base64.b64encode(os.urandom(32)).decode()
    extra = f'database_url = "{db}"\nstorage_url = "file://{storage}"\nmaster_key = "{key}"\n'
    sim_config(path, sim_url, 64, extra)


def cli(config: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "backfill.cli", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def serve(config: Path, role: str, port: int | None = None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "backfill.cli", "serve", "--role", role, "--config", str(config)]
    if port:
        args += ["--port", str(port)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: [0] is the state, [1] the parent
    pid, [11] utime, [12] stime, [13] cutime, [14] cstime (in clock ticks)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def postmaster_pid(backend_pid: int) -> int | None:
    """The PostgreSQL postmaster, found as the parent of one of its backends (our own
    connection's, from pg_backend_pid()); None when that backend is not visible here (the server
    runs on another machine or in another process namespace) or is not a postgres process."""
    try:
        if Path(f"/proc/{backend_pid}/comm").read_text().strip() != "postgres":
            return None
        parent = int(_stat(backend_pid)[1])
        if Path(f"/proc/{parent}/comm").read_text().strip() != "postgres":
            return None
        _stat(parent)
    except (OSError, ValueError, IndexError):
        return None
    return parent


def server_cpu_seconds(postmaster: int) -> float:
    """CPU seconds (user + system) spent so far by the whole PostgreSQL server.

    Every server process (backends, checkpointer, WAL writer, autovacuum, parallel workers) is
    a direct child of the postmaster, and backends come and go during a run. The total is the
    postmaster's own utime + stime, plus its cutime + cstime (the CPU of every child it has
    already reaped, which the kernel adds there when the child is waited for), plus utime +
    stime of each child still alive (zombies included, which are not reaped yet). A backend
    alive at both samples contributes its delta; one that starts after the first sample
    contributes all its CPU; one that ends in between contributes its CPU before the first
    sample through the live sum and all of it afterwards through cutime, so the difference of
    two totals is exactly the CPU spent in between, whatever came and went; a reused pid does
    not matter either, as nothing is matched by pid. The postmaster is read first: a child
    reaped after that read and gone before its own read is missed (an undercount of at most one
    exiting backend per sample), but never counted twice.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    own = _stat(postmaster)
    total = sum(int(x) for x in own[11:15])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat(int(entry.name))
        except (OSError, IndexError):
            continue  # it ended while we looked
        if int(fields[1]) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


@dataclass
class Sample:
    """Counters read at the start and at the end of a drain."""

    wal_lsn: str
    server_cpu: float | None
    backfill_cpu: float
    busy: int
    jiffies: int


class Primary:
    """One admin connection to the PostgreSQL server, held open for the whole drain so that
    sampling does not itself start and end a backend in the measured interval."""

    def __init__(self, runner: asyncio.Runner, admin_url: str) -> None:
        self.runner = runner
        self.conn: Any = runner.run(asyncpg.connect(admin_url))
        backend: int = runner.run(self.conn.fetchval("SELECT pg_backend_pid()"))
        self.postmaster = postmaster_pid(backend)

    def close(self) -> None:
        self.runner.run(self.conn.close())

    def wal_lsn(self) -> str:
        return str(self.runner.run(self.conn.fetchval("SELECT pg_current_wal_lsn()::text")))

    def wal_bytes(self, since: str, until: str) -> int:
        query = "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)"
        return int(self.runner.run(self.conn.fetchval(query, until, since)))

    def sample(self, pids: list[int], *, start: bool) -> Sample:
        # At the start the WAL position is read before the CPU, at the end after it, so the
        # CPU of the query that reads it falls outside the interval.
        lsn = self.wal_lsn() if start else ""
        cpu = None if self.postmaster is None else server_cpu_seconds(self.postmaster)
        busy, jiffies = machine_busy()
        mine = sum(cpu_seconds(pid) for pid in pids)
        if not start:
            lsn = self.wal_lsn()
        return Sample(lsn, cpu, mine, busy, jiffies)


@dataclass
class Churn:
    dead: int
    updates: int
    hot: int


async def items_churn(url: str) -> Churn:
    """n_dead_tup, n_tup_upd and n_tup_hot_upd of ``items``, once the Backfill processes are
    gone. Backends report their counters at most once a second and when they exit, so the
    figures are read until two readings half a second apart agree."""
    conn = await asyncpg.connect(url)
    try:
        last: tuple[int, int, int] | None = None
        deadline = time.monotonic() + 15
        while True:
            row = await conn.fetchrow(
                "SELECT n_dead_tup, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                " WHERE schemaname = 'public' AND relname = 'items'"
            )
            now = (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)
            if now == last or time.monotonic() > deadline:
                return Churn(*now)
            last = now
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


@dataclass
class Run:
    elapsed: float
    busy: float
    server_cpu: float | None
    wal: int
    backfill_cpu: float
    churn: Churn | None = None


def drain(config: Path, workers: int, source: Path, total: int, primary: Primary) -> Run:
    port = free_port()
    api = serve(config, "api", port)
    procs = [api]
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        key = cli(config, "admin", "key", "create", "--org", "bench").splitlines()[-1]
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        )
        file_id = upload(client, source)
        procs += [serve(config, "worker") for _ in range(workers)]
        time.sleep(3)  # let the workers start and see their engine healthy
        pids = [process.pid for process in procs]
        before = primary.sample(pids, start=True)
        start = time.perf_counter()
        batch = wait_batch(client, create_batch(client, file_id))
        elapsed = time.perf_counter() - start
        after = primary.sample(pids, start=False)
        assert batch["request_counts"]["completed"] == total, batch
        return Run(
            elapsed=elapsed,
            busy=(after.busy - before.busy) / max(after.jiffies - before.jiffies, 1),
            server_cpu=(
                None
                if after.server_cpu is None or before.server_cpu is None
                else after.server_cpu - before.server_cpu
            ),
            wal=primary.wal_bytes(before.wal_lsn, after.wal_lsn),
            backfill_cpu=after.backfill_cpu - before.backfill_cpu,
        )
    finally:
        for process in procs:
            stop(process)


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("worker counts must be 1 or more")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument(
        "--workers",
        type=worker_counts,
        default=[1, 2, 3],
        help="worker process counts to run, comma separated; the first is the baseline",
    )
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    n: int = args.requests
    counts: list[int] = list(dict.fromkeys(args.workers))
    sim, sim_url = start_simulator("--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "8")
    results: dict[int, Run] = {}
    with asyncio.Runner() as runner:
        primary = Primary(runner, args.pg)
        try:
            autovacuum = runner.run(primary.conn.fetchval("SHOW autovacuum"))
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                source = work / "input.jsonl"
                source.write_bytes(b"".join(request_line(i, 8) for i in range(n)))
                for workers in counts:
                    db = runner.run(fresh_database(args.pg))
                    config = work / f"w{workers}.toml"
                    write_config(config, db, work / f"blobs{workers}", sim_url)
                    cli(config, "db", "upgrade")
                    cli(config, "admin", "org", "create", "bench")
                    cli(config, "admin", "credit", "add", "--org", "bench", "--usd", "1000")
                    try:
                        run = drain(config, workers, source, n, primary)
                        run.churn = runner.run(items_churn(db))
                        results[workers] = run
                    finally:
                        runner.run(drop_database(args.pg, db))
        finally:
            primary.close()
            stop(sim)
    base = results[counts[0]].elapsed
    print(f"{n} requests on PostgreSQL, simulated engine (5 ms), 64 in flight/worker")
    for workers, run in results.items():
        print(
            f"{workers} worker(s): {run.elapsed:6.2f} s  {n / run.elapsed:7.1f} req/s  "
            f"{base / run.elapsed:.2f}x  machine CPU busy {run.busy:.0%}"
        )
    print()
    print(
        "Cost per request line on the PostgreSQL primary, from batch creation to completion "
        f"(autovacuum {autovacuum}):"
    )
    print(
        "workers  PG CPU µs/line  WAL bytes/line  Backfill CPU s/1k lines  "
        "items dead/line  updates/line  HOT updates"
    )
    for workers, run in results.items():
        pg_cpu = "n/a" if run.server_cpu is None else f"{run.server_cpu / n * 1e6:.0f}"
        churn = run.churn or Churn(0, 0, 0)
        hot = f"{churn.hot / churn.updates:.0%}" if churn.updates else "n/a"
        print(
            f"{workers:>7}  {pg_cpu:>14}  {run.wal / n:>14.0f}  "
            f"{run.backfill_cpu / n * 1000:>23.3f}  {churn.dead / n:>15.2f}  "
            f"{churn.updates / n:>12.2f}  {hot:>11}"
        )
    if any(run.server_cpu is None for run in results.values()):
        print(
            "PG CPU n/a: the server's processes are not visible on this machine "
            "(remote or in another process namespace)."
        )


if __name__ == "__main__":
    main()
