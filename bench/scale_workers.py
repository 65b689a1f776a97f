"""Drain throughput on PostgreSQL with 1, 2 and 3 worker processes (SPEC §2 scale-out).

    PYTHONPATH=. python -m bench.scale_workers [--requests 6000] [--pg postgresql://postgres@127.0.0.1/test]

One API process and N workers share a fresh PostgreSQL database and one storage directory.
The simulated engine answers in ~5 ms with no concurrency cap, so the engine is not the
bottleneck; each worker may hold 64 requests in flight. The baseline is one worker.
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
from pathlib import Path

import asyncpg
import httpx

from bench.common import (
    free_port,
    multipart,
    request_line,
    sim_config,
    start_simulator,
    stop,
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


def drain(config: Path, workers: int, source: Path, total: int) -> tuple[float, float]:
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
        body, content_type = multipart(source)
        uploaded = client.post("/v1/files", content=body, headers={"Content-Type": content_type})
        uploaded.raise_for_status()
        procs += [serve(config, "worker") for _ in range(workers)]
        time.sleep(3)  # let the workers start and see their engine healthy
        busy_before, total_before = machine_busy()
        start = time.perf_counter()
        batch = client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.1)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        elapsed = time.perf_counter() - start
        busy_after, total_after = machine_busy()
        assert batch["request_counts"]["completed"] == total, batch
        return elapsed, (busy_after - busy_before) / max(total_after - total_before, 1)
    finally:
        for process in procs:
            stop(process)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    sim, sim_url = start_simulator("--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "8")
    results: dict[int, tuple[float, float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            source = work / "input.jsonl"
            source.write_bytes(b"".join(request_line(i, 8) for i in range(args.requests)))
            for workers in (1, 2, 3):
                db = asyncio.run(fresh_database(args.pg))
                config = work / f"w{workers}.toml"
                write_config(config, db, work / f"blobs{workers}", sim_url)
                cli(config, "db", "upgrade")
                cli(config, "admin", "org", "create", "bench")
                cli(config, "admin", "credit", "add", "--org", "bench", "--usd", "1000")
                try:
                    results[workers] = drain(config, workers, source, args.requests)
                finally:
                    asyncio.run(drop_database(args.pg, db))
    finally:
        stop(sim)
    base = results[1][0]
    print(f"{args.requests} requests on PostgreSQL, simulated engine (5 ms), 64 in flight/worker")
    for workers, (elapsed, busy) in results.items():
        print(
            f"{workers} worker(s): {elapsed:6.2f} s  {args.requests / elapsed:7.1f} req/s  "
            f"{base / elapsed:.2f}x  machine CPU busy {busy:.0%}"
        )


if __name__ == "__main__":
    main()
