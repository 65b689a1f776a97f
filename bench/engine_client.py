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
import resource
import time
from statistics import mean
from typing import Any

import aiohttp
import orjson

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from bench.common import MODEL, request_line, start_simulator, stop

CHAT = "/v1/chat/completions"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def bare(url: str, bodies: list[bytes], concurrency: int) -> None:
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(body: bytes) -> None:
            async with (
                slots,
                session.post(
                    url + "/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response,
            ):
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
                await response.read()

        await asyncio.gather(*(one(b) for b in bodies))


async def adapter(url: str, bodies: list[dict[str, Any]], concurrency: int) -> None:
    engine = OpenAIHttpEngine("sim", url, {MODEL: MODEL}, max_concurrency=concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> None:
        async with slots:
            reply = await engine.send(CHAT, MODEL, body)
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}")

    try:
        await asyncio.gather(*(one(b) for b in bodies))
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
    try:
        parsed = [orjson.loads(request_line(i, 64))["body"] for i in range(args.requests)]
        raw = [orjson.dumps(body) for body in parsed]
        measured: dict[str, list[tuple[float, float]]] = {"bare": [], "adapter": []}
        for r in range(args.rounds):
            for side in ("bare", "adapter") if r % 2 == 0 else ("adapter", "bare"):
                cpu, start = _cpu(), time.perf_counter()
                if side == "bare":
                    asyncio.run(bare(url, raw, args.concurrency))
                else:
                    asyncio.run(adapter(url, parsed, args.concurrency))
                measured[side].append((time.perf_counter() - start, _cpu() - cpu))
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
