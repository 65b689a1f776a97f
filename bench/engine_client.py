"""The engine client alone: CPU per request of Backfill's engine adapter against a bare aiohttp
client, the same requests to the same simulator at the same concurrency (SPEC §12).

    PYTHONPATH=. python -m bench.engine_client              # 10,000 requests, concurrency 128
    PYTHONPATH=. python -m bench.engine_client --rounds 3

Each round runs the two clients one after the other (their order alternating between rounds,
so a drift of the machine falls on both alike); the figures are the means. The adapter's side
is ``OpenAIHttpEngine.send``: the model renamed, the body encoded, the lean HTTP/1.1 client
(``adapters/engines/http1.py``). No database, no batch: what sending costs, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from statistics import mean
from typing import Any

import orjson

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from bench.common import MODEL, own_cpu, request_line, start_simulator, stop
from bench.drain import baseline

CHAT = "/v1/chat/completions"


async def adapter(url: str, lines: list[bytes], concurrency: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) to send ``lines`` through the adapter."""
    bodies: list[dict[str, Any]] = [orjson.loads(line)["body"] for line in lines]
    engine = OpenAIHttpEngine("sim", url, {MODEL: MODEL}, max_concurrency=concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> None:
        async with slots:
            reply = await engine.send(CHAT, MODEL, body)
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}")

    cpu_before, start = own_cpu(), time.perf_counter()
    try:
        await asyncio.gather(*(one(b) for b in bodies))
    finally:
        await engine.close()
    return time.perf_counter() - start, own_cpu() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
    try:
        lines = [request_line(i, 64) for i in range(args.requests)]
        measured: dict[str, list[tuple[float, float]]] = {"bare": [], "adapter": []}
        for r in range(args.rounds):
            for side in ("bare", "adapter") if r % 2 == 0 else ("adapter", "bare"):
                run = baseline if side == "bare" else adapter
                measured[side].append(asyncio.run(run(url, lines, args.concurrency)))
    finally:
        stop(engine)
    n = args.requests
    print(f"{n} requests, concurrency {args.concurrency}, {args.rounds} rounds (means)")
    figures = {
        side: (mean(r[0] for r in runs), mean(r[1] for r in runs))
        for side, runs in measured.items()
    }
    for side, label in (("bare", "bare aiohttp client"), ("adapter", "Backfill's engine adapter")):
        took, cpu = figures[side]
        print(f"{label:<26}: {took:6.2f} s  CPU {cpu / n * 1000:.3f} s per 1,000 requests")
    ratio = figures["adapter"][1] / figures["bare"][1]
    print(f"adapter / bare, CPU per request: {ratio:.2f}x")


if __name__ == "__main__":
    main()
