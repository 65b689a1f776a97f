"""Status polls while a batch drains (SPEC §12): ``GET /v1/batches/{id}`` from many concurrent
pollers, with the queue idle and then under a drain of about 1,000 requests a second.

    PYTHONPATH=. python -m bench.polls                      # 50 pollers, 30,000 requests
    PYTHONPATH=. python -m bench.polls --pollers 90 --interval 0.5
    PYTHONPATH=. python -m bench.polls --split    # the API and the worker as two processes

Each poller asks for the batch, waits ``--interval`` seconds and asks again, starting at a random
moment of its first interval (users' polls are not in step). Latency is the client's: from
sending the request to the last byte of the answer. The baseline is the same pollers against
the same server with the queue idle (the batch already ended), measured in the same run.

``backfill up`` serves polls on the event loop that also drains the queue. With ``--split`` the
same SQLite database is served by two processes, ``backfill serve --role api`` and ``--role
worker``, so polls have an event loop (and a core) of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from statistics import quantiles

import aiohttp
import httpx

from bench.common import (
    create_batch,
    free_port,
    request_line,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
    upload,
    wait_batch,
    wait_http,
)
from bench.scale_workers import cli, serve


async def poll(
    base: str, key: str, batch_id: str, pollers: int, interval_s: float, until: asyncio.Event
) -> list[float]:
    """Latencies (s) of every poll made until ``until`` is set."""
    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base, connector=connector, headers=headers) as session:

        async def poller() -> None:
            await asyncio.sleep(random.uniform(0, interval_s))
            while not until.is_set():
                started = time.perf_counter()
                async with session.get(f"/v1/batches/{batch_id}") as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"poll answered {response.status}")
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(interval_s)

        await asyncio.gather(*(poller() for _ in range(pollers)))
    return latencies


async def poll_for(
    base: str, key: str, batch_id: str, pollers: int, interval_s: float, seconds: float
) -> list[float]:
    until = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, until.set)
    return await poll(base, key, batch_id, pollers, interval_s, until)


def start_split(
    work: Path, url: str, concurrency: int
) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    """An API process and a worker process on one SQLite database; (processes, URL, key)."""
    master = base64.b64encode(os.urandom(32)).decode()
    extra = (
        f'database_url = "sqlite:///{work}/backfill.db"\n'
        f'storage_url = "file://{work}/blobs"\nmaster_key = "{master}"\n'
    )
    config = sim_config(work / "split.toml", url, concurrency, extra)
    cli(config, "db", "upgrade")
    cli(config, "admin", "org", "create", "bench")
    cli(config, "admin", "credit", "add", "--org", "bench", "--usd", "1000")
    key = cli(config, "admin", "key", "create", "--org", "bench").splitlines()[-1]
    port = free_port()
    processes = [serve(config, "api", port), serve(config, "worker")]
    wait_http(f"http://127.0.0.1:{port}/healthz")
    return processes, f"http://127.0.0.1:{port}", key


def percentiles(latencies: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    cuts = quantiles(latencies, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measurement")
    parser.add_argument("--split", action="store_true", help="API and worker in two processes")
    args = parser.parse_args()
    # About 1,100 requests a second at concurrency 128: 50 ms to the first token, 64 tokens.
    engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if args.split:
                processes, base, key = start_split(work, url, args.concurrency)
            else:
                config = sim_config(work / "polls.toml", url, args.concurrency)
                process, base, key = start_backfill(config, work / "data", work / "server.log")
                processes = [process]
            try:
                client = httpx.Client(
                    base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600
                )
                source = work / "input.jsonl"
                source.write_bytes(b"".join(request_line(i) for i in range(args.requests)))
                file_id = upload(client, source)
                # Idle: a small batch that has ended is polled, nothing else runs.
                small = work / "small.jsonl"
                small.write_bytes(b"".join(request_line(i) for i in range(10)))
                ended = wait_batch(client, create_batch(client, upload(client, small)))
                idle = asyncio.run(
                    poll_for(base, key, ended["id"], args.pollers, args.interval, args.seconds)
                )
                batch = create_batch(client, file_id)
                started = time.perf_counter()
                time.sleep(2)  # past the start-up of the drain
                busy = asyncio.run(
                    poll_for(base, key, batch["id"], args.pollers, args.interval, args.seconds)
                )
                during = client.get(f"/v1/batches/{batch['id']}").json()
                done = during["request_counts"]["completed"]
                rate = done / (time.perf_counter() - started)
                if during["status"] != "in_progress":
                    raise RuntimeError("the batch ended before the measurement did: add requests")
                wait_batch(client, batch, 1.0)
            finally:
                for process in processes:
                    stop(process)
    finally:
        stop(engine)
    idle_p50, idle_p99 = percentiles(idle)
    busy_p50, busy_p99 = percentiles(busy)
    served = "API and worker in two processes" if args.split else "backfill up"
    print(
        f"{served}: {args.pollers} pollers, one poll each every {args.interval:g} s, "
        f"{args.seconds:g} s per measurement"
    )
    print(
        f"queue idle        : p50 {idle_p50:6.1f} ms  p99 {idle_p99:6.1f} ms  ({len(idle)} polls)"
    )
    print(
        f"during the drain  : p50 {busy_p50:6.1f} ms  p99 {busy_p99:6.1f} ms  ({len(busy)} polls, "
        f"drain at {rate:,.0f} req/s)"
    )
    print(f"drain vs idle     : p50 {busy_p50 / idle_p50:.2f}x  p99 {busy_p99 / idle_p99:.2f}x")


if __name__ == "__main__":
    main()
