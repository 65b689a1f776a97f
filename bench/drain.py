"""End-to-end drain throughput vs a bare asyncio client against the same engine (SPEC §12).

    PYTHONPATH=. python -m bench.drain        # simulator: 20,000 requests, concurrency 128
    PYTHONPATH=. python -m bench.drain --engine llama --requests 48 --concurrency 2 \
        --max-tokens 32 --rounds 6      # the real engine, six A-B-B-A rounds
    PYTHONPATH=. python -m bench.drain --engine llama --requests 48 --concurrency 2 \
        --max-tokens 32 --mode both     # the engine dedicated, then shared (no live traffic)
    PYTHONPATH=. python -m bench.drain --pg postgresql://postgres@127.0.0.1:5432/test
                                        # on SQLite, then on PostgreSQL, A-B-B-A

The baseline sends every request straight to the engine with an aiohttp client holding
``concurrency`` requests in flight. Backfill runs as ``backfill up`` with the same engine at
the same ``max_concurrency``; its time runs from batch creation (file already uploaded) to
``completed`` (polled every 50 ms once its end is near). CPU seconds of the
Backfill process are read from /proc over the same span. With ``--rounds N`` the bare client
and Backfill run N times each, in A-B-B-A order, and each round's ratio is printed beside the
means: on a machine whose speed drifts between runs, each run is compared with its neighbour.
With ``--mode shared`` the engine is configured ``shared`` (docs/scheduling.md): with no live
traffic on it, it should drain as fast as a dedicated one; ``--mode both`` runs the two,
``--rounds`` times each in A-B-B-A order (so a drift of the machine over the run falls on both
alike), and reports each mode's mean. With ``--pg`` (an admin URL) the same drain runs on
SQLite and on a fresh PostgreSQL database, ``--rounds`` times each in A-B-B-A order; the CPU
of the Backfill process is compared (PostgreSQL's own server processes are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean

import aiohttp
import asyncpg
import httpx
import orjson

from bench.common import (
    MODEL,
    cpu_seconds,
    create_batch,
    free_port,
    own_cpu,
    request_line,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
    upload,
    wait_batch,
    wait_http,
)
from bench.scale_workers import (
    drop_database,
    fresh_database,
    postmaster_pid,
    server_cpu_seconds,
)

LLAMA_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


async def baseline(url: str, lines: list[bytes], concurrency: int) -> tuple[float, float]:
    bodies = [orjson.dumps(orjson.loads(line)["body"]) for line in lines]
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(body: bytes) -> None:
            async with (
                slots,
                session.post(
                    url + "/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response,
            ):
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"engine answered {response.status}")

        cpu_before = own_cpu()
        start = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - start, own_cpu() - cpu_before


def run_backfill(
    config: Path,
    data: Path,
    log: Path,
    source: Path,
    total: int,
    poll_s: float,
    server_cpu: Callable[[], float] = lambda: 0.0,
    fine_poll_s: float | None = None,
) -> tuple[float, float, float]:
    """(seconds, CPU seconds of the Backfill process, of ``server_cpu``) from batch creation
    to its end, polled every ``poll_s`` (and ``fine_poll_s`` near its end: ``wait_batch``)."""
    process, base, key = start_backfill(config, data, log)
    try:
        client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600
        )
        file_id = upload(client, source)
        cpu_before, server_before = cpu_seconds(process.pid), server_cpu()
        start = time.perf_counter()
        batch = wait_batch(client, create_batch(client, file_id), poll_s, fine_poll_s=fine_poll_s)
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(process.pid) - cpu_before
        server = server_cpu() - server_before
        counts = batch["request_counts"]
        if batch["status"] != "completed" or counts["completed"] != total:
            raise RuntimeError(f"batch ended {batch['status']} with {counts}")
        return elapsed, cpu, server
    finally:
        stop(process)


def start_llama() -> tuple[subprocess.Popen[bytes], str]:
    from backfill.adapters.engines.managed import smollm2_gguf

    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(smollm2_gguf()),
            "--model_alias",
            LLAMA_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--n_threads",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=120)
    return process, f"http://127.0.0.1:{port}/v1"


def compare_databases(args: argparse.Namespace) -> None:
    """The same drain on SQLite and on PostgreSQL: the Backfill process's CPU per request."""
    rounds = args.rounds or 2
    order = [
        d for r in range(rounds) for d in (("sqlite", "pg") if r % 2 == 0 else ("pg", "sqlite"))
    ]
    engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
    measured: dict[str, list[tuple[float, float, float]]] = {"sqlite": [], "pg": []}
    postmaster = asyncio.run(_postmaster(args.pg))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            lines = [request_line(i, args.max_tokens) for i in range(args.requests)]
            source = work / "input.jsonl"
            source.write_bytes(b"".join(lines))
            for n, database in enumerate(order):
                db_url = asyncio.run(fresh_database(args.pg)) if database == "pg" else None
                extra = f'database_url = "{db_url}"' if db_url else ""
                config = sim_config(work / f"{n}.toml", url, args.concurrency, extra)
                try:
                    measured[database].append(
                        run_backfill(
                            config,
                            work / f"data-{n}",
                            work / f"server-{n}.log",
                            source,
                            args.requests,
                            poll_s=0.05,
                            server_cpu=_server_cpu(postmaster if database == "pg" else None),
                        )
                    )
                finally:
                    if db_url:
                        asyncio.run(drop_database(args.pg, db_url))
    finally:
        stop(engine)
    n = args.requests
    print(f"{n} requests, concurrency {args.concurrency}, {rounds} rounds (means)")
    cpu = {}
    for database, runs in measured.items():
        took, cpu[database] = mean(r[0] for r in runs), mean(r[1] for r in runs)
        server = mean(r[2] for r in runs)
        print(
            f"{database:<7}: {took:7.2f} s  {n / took:8.1f} req/s  "
            f"Backfill CPU {cpu[database] / n * 1000:.3f} s per 1,000 requests"
            + (f", PostgreSQL server {server / n * 1000:.3f} s" if database == "pg" else "")
        )
    print(f"PostgreSQL / SQLite, Backfill CPU per request: {cpu['pg'] / cpu['sqlite']:.2f}x")


async def _postmaster(admin_url: str) -> int | None:
    conn = await asyncpg.connect(admin_url)
    try:
        return postmaster_pid(int(await conn.fetchval("SELECT pg_backend_pid()")))
    finally:
        await conn.close()


def _server_cpu(postmaster: int | None) -> Callable[[], float]:
    """The PostgreSQL server's CPU so far (0 where its processes are not visible here)."""
    if postmaster is None:
        return lambda: 0.0
    return lambda: server_cpu_seconds(postmaster)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["sim", "llama"], default="sim")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mode", choices=["dedicated", "shared", "both"], default="dedicated")
    parser.add_argument("--rounds", type=int, default=None, help="default: 2 with both, else 1")
    parser.add_argument("--pg", default=None, help="also on PostgreSQL (its admin URL)")
    args = parser.parse_args()
    if args.pg:
        compare_databases(args)
        return
    modes = ["dedicated", "shared"] if args.mode == "both" else [args.mode]
    rounds = args.rounds or (2 if args.mode == "both" else 1)
    # The bare client runs in every round too, in A-B-B-A order with Backfill's modes: on a
    # machine whose speed drifts by 10% between runs, each is compared with its neighbours.
    sides = ["bare", *modes]
    order = [m for r in range(rounds) for m in (sides if r % 2 == 0 else sides[::-1])]
    if args.engine == "sim":
        engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
        model = MODEL
    else:
        engine, url = start_llama()
        model = LLAMA_MODEL
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            # Greedy decoding on a real model: its answers (and so the work) are then the same
            # in every run; sampled, their lengths moved a run's time by up to 8%.
            temperature = 0.2 if model == MODEL else 0.0
            lines = [
                request_line(i, args.max_tokens, model, temperature) for i in range(args.requests)
            ]
            source = work / "input.jsonl"
            source.write_bytes(b"".join(lines))
            measured: dict[str, list[tuple[float, float, float]]] = {m: [] for m in sides}
            for n, mode in enumerate(order):
                if mode == "bare":
                    took, cpu = asyncio.run(baseline(url, lines, args.concurrency))
                    measured["bare"].append((took, cpu, 0.0))
                    continue
                config = sim_config(
                    work / f"{mode}.toml", url, args.concurrency, engine=f'mode = "{mode}"'
                )
                if model != MODEL:
                    text = config.read_text().replace(f'"{MODEL}"', f'"{model}"')
                    config.write_text(text)
                measured[mode].append(
                    run_backfill(
                        config,
                        work / f"data-{n}",
                        work / f"server-{n}.log",
                        source,
                        args.requests,
                        # A poll a second until the batch's end is near, then one every 50
                        # ms. The bare client makes no polls and knows its end at once; a
                        # poll costs the server about 2 ms of CPU (on a CPU-bound local
                        # engine, CPU the model misses), and four a second still saw the
                        # end up to 0.25 s late, 2% of a run on llama.cpp.
                        poll_s=1.0,
                        fine_poll_s=0.05,
                    )
                )
    finally:
        stop(engine)
    n = args.requests
    print(
        f"engine: {args.engine}, {n} requests, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}" + (f", {rounds} rounds (means)" if rounds > 1 else "")
    )
    bare = measured.pop("bare")
    base_s, base_cpu = mean(r[0] for r in bare), mean(r[1] for r in bare)
    print(f"bare asyncio client : {base_s:7.2f} s  {n / base_s:8.1f} req/s  1.00x")
    print(
        f"bare client CPU     : {base_cpu:7.2f} s  {base_cpu / n * 1000:.3f} s per 1,000 requests"
    )
    runs = {m: (mean(r[0] for r in ts), mean(r[1] for r in ts)) for m, ts in measured.items()}
    for mode, (backfill_s, cpu) in runs.items():
        label = "backfill up" if mode == "dedicated" else f"backfill up ({mode})"
        print(
            f"{label:<20}: {backfill_s:7.2f} s  {n / backfill_s:8.1f} req/s  "
            f"{base_s / backfill_s:.2f}x"
        )
        print(f"{'  its CPU':<20}: {cpu:7.2f} s  {cpu / n * 1000:.3f} s per 1,000 requests")
        if rounds > 1:
            each = ", ".join(
                f"{b[0] / r[0]:.2f}x" for b, r in zip(bare, measured[mode], strict=True)
            )
            print(f"{'  each round':<20}: {each} (against that round's bare client)")
    if len(runs) == 2:
        ratio = runs["dedicated"][0] / runs["shared"][0]
        print(f"shared / dedicated  : {ratio:.2f}x the drain rate (target >= 0.95x)")


if __name__ == "__main__":
    main()
