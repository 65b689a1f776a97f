"""How much CPU Backfill takes when it has little or nothing to do (SPEC §12): idle, and
waiting on a slow engine. On a CPU-only machine the engine shares the cores, so every
CPU-millisecond Backfill spends there is taken from the model.

    PYTHONPATH=. python -m bench.quiet            # 60 s idle, then 60 s waiting on the engine
    PYTHONPATH=. python -m bench.quiet --seconds 30

Idle: ``backfill up`` with one simulated engine and no batch, after its start-up. Waiting: a
batch of slow requests (2 engine slots, 2 s per request) drains while nobody polls it. CPU
seconds of the Backfill process are read from /proc, as a share of one core. The baseline of
the waiting run is a bare asyncio client sending the same requests to the same engine over the
same span, also as a share of one core: what the work itself costs without a batch layer.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench.common import (
    cpu_seconds,
    create_batch,
    own_cpu,
    request_line,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
    upload,
)

SLOTS = 2
REQUEST_S = 2.0
# Backfill and the bare client settle this long before the CPU is counted (start-up, imports).
SETTLE_S = 8.0


def share(cpu_s: float, wall_s: float) -> str:
    return f"{cpu_s / wall_s * 100:5.2f}% of a core ({cpu_s * 1000:.0f} ms over {wall_s:.0f} s)"


def measure_idle(work: Path, url: str, seconds: float) -> tuple[float, float]:
    config = sim_config(work / "idle.toml", url, SLOTS)
    process, _, _ = start_backfill(config, work / "idle-data", work / "idle.log")
    try:
        time.sleep(SETTLE_S)
        before, start = cpu_seconds(process.pid), time.monotonic()
        time.sleep(seconds)
        return cpu_seconds(process.pid) - before, time.monotonic() - start
    finally:
        stop(process)


def measure_waiting(work: Path, url: str, seconds: float, lines: int) -> tuple[float, float]:
    config = sim_config(work / "waiting.toml", url, SLOTS)
    process, base, key = start_backfill(config, work / "waiting-data", work / "waiting.log")
    try:
        source = work / "waiting.jsonl"
        source.write_bytes(b"".join(request_line(i, 16) for i in range(lines)))
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as client:
            batch = create_batch(client, upload(client, source))
            time.sleep(SETTLE_S)
            before, start = cpu_seconds(process.pid), time.monotonic()
            time.sleep(seconds)
            cpu, wall = cpu_seconds(process.pid) - before, time.monotonic() - start
            status = client.get(f"/v1/batches/{batch['id']}").json()
        done = status["request_counts"]["completed"]
        if status["status"] != "in_progress" or done >= lines:
            raise RuntimeError(f"the batch must still run when measured; it is {status}")
        return cpu, wall
    finally:
        stop(process)


async def bare_client(url: str, seconds: float) -> tuple[float, float]:
    """The same slow requests, SLOTS at a time, for ``seconds``: this process's CPU."""
    body = orjson.dumps(orjson.loads(request_line(0, 16))["body"])
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def slot() -> None:
            while time.monotonic() < stop_at:
                async with session.post(
                    url + "/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response:
                    await response.read()

        before, start = own_cpu(), time.monotonic()
        await asyncio.gather(*(slot() for _ in range(SLOTS)))
        return own_cpu() - before, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    # A request takes REQUEST_S whatever its length: all of it is time to first token.
    engine, url = start_simulator(
        "--ttft-ms", str(REQUEST_S * 1000), "--itl-ms", "0", "--output-tokens", "8"
    )
    # Enough lines that the batch still runs when the measurement ends.
    lines = int((SETTLE_S + args.seconds) / REQUEST_S * SLOTS * 2) + 10
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            idle = measure_idle(work, url, args.seconds)
            waiting = measure_waiting(work, url, args.seconds, lines)
            bare = asyncio.run(bare_client(url, args.seconds))
    finally:
        stop(engine)
    print(f"idle (no batch)                   : {share(*idle)}")
    print(f"waiting ({SLOTS} slots, {REQUEST_S:g} s a request) : {share(*waiting)}")
    print(f"  bare client, the same requests  : {share(*bare)}")
    print(
        f"  waiting vs the bare client      : {waiting[0] / waiting[1] / (bare[0] / bare[1]):.2f}x"
    )


if __name__ == "__main__":
    main()
