"""50 concurrent clients against one real server for about 20 s (SPEC §3, §4, §12).

Each client (its own connection pool, asyncio + httpx) loops: upload a small file, create a
batch, poll it until it ends, download the output and check it; it starts no new round after
20 s and stops polling at the latest 30 s later, so the test ends by itself. The server's
unfinished-batch limit is raised so admission control does not refuse the load. Every response
must be 2xx and no call may raise; every batch must complete with one row per line. The p50 and
p99 latency of the polls is printed.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support import (
    TERMINAL,
    ServerProcess,
    SimulatorProcess,
    chat_line,
    jsonl,
    start_server_process,
    start_simulator_process,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLIENTS = 50
DURATION_S = 20.0
GRACE_S = 30.0
LINES = 5
SEED = 4242


@dataclass
class Tally:
    poll_latencies: list[float] = field(default_factory=list)
    calls: int = 0
    errors: list[str] = field(default_factory=list)
    batches: int = 0
    completed: int = 0
    unfinished: list[str] = field(default_factory=list)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    sim: SimulatorProcess = start_simulator_process("--ttft-ms", "5", "--itl-ms", "0")
    try:
        process = start_server_process(
            tmp_path, sim.base_url, extra="max_unfinished_batches = 1000"
        )
        try:
            yield process
        finally:
            process.stop()
    finally:
        sim.stop()


async def one_client(n: int, server: ServerProcess, stop_at: float, tally: Tally) -> None:
    rng = random.Random(SEED + n)

    async def call(method: str, url: str, **kwargs: Any) -> httpx.Response:
        tally.calls += 1
        response = await client.request(method, url, **kwargs)
        if not 200 <= response.status_code < 300:
            tally.errors.append(f"{method} {url}: {response.status_code} {response.text[:200]}")
            raise _Stop
        return response

    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.port}",
        headers={"Authorization": f"Bearer {server.key}"},
        timeout=30,
    ) as client:
        rounds = 0
        try:
            while time.monotonic() < stop_at:
                ids = [f"client{n}-round{rounds}-{i}" for i in range(LINES)]
                content = jsonl([chat_line(c, f"question {c}") for c in ids])
                uploaded = await call(
                    "POST",
                    "/v1/files",
                    data={"purpose": "batch"},
                    files={"file": ("in.jsonl", content, "application/jsonl")},
                )
                created = await call(
                    "POST",
                    "/v1/batches",
                    json={
                        "input_file_id": uploaded.json()["id"],
                        "endpoint": "/v1/chat/completions",
                        "completion_window": "24h",
                    },
                )
                batch_id = created.json()["id"]
                tally.batches += 1
                while True:
                    await asyncio.sleep(rng.uniform(0.1, 0.3))
                    started = time.perf_counter()
                    polled = await call("GET", f"/v1/batches/{batch_id}")
                    tally.poll_latencies.append(time.perf_counter() - started)
                    batch = polled.json()
                    if batch["status"] in TERMINAL:
                        break
                    if time.monotonic() > stop_at + GRACE_S:
                        tally.unfinished.append(f"{batch_id} {batch['request_counts']}")
                        raise _Stop
                assert batch["status"] == "completed", batch
                output = await call("GET", f"/v1/files/{batch['output_file_id']}/content")
                got = sorted(
                    orjson.loads(line)["custom_id"] for line in output.content.splitlines()
                )
                assert got == sorted(ids), f"{batch_id}: {got} != {ids}"
                tally.completed += 1
                rounds += 1
        except _Stop:
            return
        except (httpx.HTTPError, AssertionError, KeyError, ValueError) as exc:
            tally.errors.append(f"client {n}: {type(exc).__name__}: {exc}")


class _Stop(Exception):
    """Ends one client after an error has been recorded."""


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def test_fifty_clients_upload_create_and_poll(server: ServerProcess) -> None:
    tally = Tally()
    started = time.monotonic()
    stop_at = started + DURATION_S
    await asyncio.gather(*(one_client(n, server, stop_at, tally) for n in range(CLIENTS)))
    elapsed = time.monotonic() - started
    latencies = tally.poll_latencies
    assert latencies, "no poll was made"
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    print(
        f"\nload: {CLIENTS} clients, {elapsed:.1f} s, {tally.calls} calls, "
        f"{tally.batches} batches ({tally.completed} completed and checked), "
        f"{len(latencies)} polls: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"mean {statistics.fmean(latencies) * 1000:.1f} ms; errors {len(tally.errors)}"
    )
    assert tally.errors == [], tally.errors[:10]
    assert tally.unfinished == [], tally.unfinished[:10]
    assert tally.completed == tally.batches
    assert tally.completed >= CLIENTS, "every client should finish at least one round"
