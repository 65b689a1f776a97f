"""SIGKILL the server again and again during one batch; lose, duplicate and double-bill nothing.

SPEC §9.6 (a worker that dies loses at most its in-flight requests; restarting any process never
loses, duplicates or double-bills a result), §6.3 (one row per custom_id), §7.3/§7.7 (settle
once, at the prices fixed at acceptance; balance = credits - charges; released at the end).

One batch of 3000 requests runs against a real ``backfill simulate`` (20 ms to first token) and
a real ``backfill up`` with ``max_concurrency = 16``. The server is SIGKILLed at seeded random
points of the batch's progress (plus a random delay), and restarted each time; a point already
passed means a kill right after the restart, while the server recovers. Then the batch must
complete with every custom_id exactly once, consistent request counts and usage, and an exact
ledger, read with ``backfill admin org ledger``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backfill.domain.money import Prices, token_charge
from tests.support import (
    SIM_PRICES,
    TERMINAL,
    ServerProcess,
    SimulatorProcess,
    batch_of,
    chat_line,
    rows_of,
    simulator_process,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOTAL = 3000
KILLS = 6
SEED = 20260
PRICES = Prices(SIM_PRICES.input, SIM_PRICES.cached_input or SIM_PRICES.input, SIM_PRICES.output)


@pytest.fixture
def slowish_sim() -> Iterator[SimulatorProcess]:
    with simulator_process("--ttft-ms", "20", "--itl-ms", "0", "--seed", "7") as process:
        yield process


def done(batch: dict[str, Any]) -> int:
    counts = batch["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


def ledger(server: ServerProcess) -> dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "backfill.cli",
            "admin",
            "org",
            "ledger",
            "default",
            "--data",
            str(server.data_dir),
            "--config",
            str(server.config),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    data: dict[str, int] = json.loads(out.stdout)
    return data


def test_repeated_sigkills_lose_duplicate_and_double_bill_nothing(
    tmp_path: Path, slowish_sim: SimulatorProcess
) -> None:
    rng = random.Random(SEED)
    # Where in the batch each kill happens, as a share of requests done, and a delay after it.
    points = sorted(rng.uniform(0.03, 0.85) for _ in range(KILLS))
    delays = [rng.uniform(0.0, 0.15) for _ in range(KILLS)]
    rows = [chat_line(f"kill-{i:04d}", f"question number {i}") for i in range(TOTAL)]
    server = start_server_process(tmp_path, slowish_sim.base_url, max_concurrency=16)
    kills: list[tuple[int, int]] = []  # (done when killed, done right after the restart)
    try:
        with server.client() as client:
            batch_id = submit(client, rows)

        for point, delay in zip(points, delays, strict=True):
            with server.client() as client:
                deadline = time.monotonic() + 60
                while True:
                    batch = batch_of(client, batch_id)
                    assert batch["status"] not in TERMINAL, (
                        f"the batch ended before kill {len(kills) + 1} ({done(batch)} done); "
                        "slow the engine down"
                    )
                    if done(batch) >= point * TOTAL:
                        break
                    assert time.monotonic() < deadline, f"stuck at {done(batch)}/{TOTAL}"
                    time.sleep(0.02)
            time.sleep(delay)
            with server.client() as client:
                at_kill = done(batch_of(client, batch_id))
            server.kill()
            server.restart()
            with server.client() as client:
                after = done(batch_of(client, batch_id))
            assert after >= at_kill, f"results counted before kill {len(kills) + 1} were lost"
            kills.append((at_kill, after))

        with server.client() as client:
            deadline = time.monotonic() + 120
            while (batch := batch_of(client, batch_id))["status"] not in TERMINAL:
                assert time.monotonic() < deadline, f"not finished after the kills: {batch}"
                time.sleep(0.1)
            out = rows_of(client, batch["output_file_id"])
            err = rows_of(client, batch["error_file_id"])
    finally:
        server.stop()

    print(f"\nkills survived: {len(kills)} (done at each kill / after restart: {kills})")
    engine_requests = slowish_sim.stats()["requests"]
    print(
        f"engine requests: {engine_requests} for {TOTAL} lines ({engine_requests - TOTAL} re-run)"
    )

    assert len(kills) == KILLS
    assert batch["status"] == "completed", batch
    seen = Counter(r["custom_id"] for r in out + err)
    duplicated = sorted(c for c, n in seen.items() if n > 1)
    assert not duplicated, f"{len(duplicated)} custom_ids twice, e.g. {duplicated[:5]}"
    assert set(seen) == {r["custom_id"] for r in rows}, "results lost"
    assert err == [], f"rows failed across the kills: {err[:3]}"
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert batch["request_counts"] == {"total": TOTAL, "completed": len(out), "failed": 0}
    assert engine_requests >= TOTAL

    usages = [r["response"]["body"]["usage"] for r in out]
    input_tokens = sum(u["prompt_tokens"] for u in usages)
    output_tokens = sum(u["completion_tokens"] for u in usages)
    assert batch["usage"]["input_tokens"] == input_tokens
    assert batch["usage"]["output_tokens"] == output_tokens
    expected_charges = sum(
        token_charge(
            PRICES,
            u["prompt_tokens"],
            (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            u["completion_tokens"],
        )
        for u in usages
    )

    money = ledger(server)
    print(f"ledger: {money}")
    assert money["receipts"] == len(out), "a result was charged twice, or not at all"
    assert money["charges"] == expected_charges, "charges differ from the delivered usage"
    assert money["balance"] == money["credits"] - money["charges"]
    assert money["reserved"] == 0, "reservation not released at the end"
