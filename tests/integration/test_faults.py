"""Engine faults against the in-process simulator: what is retried, and where each row ends up.

SPEC §9.2 (transient failures retry with backoff honouring ``Retry-After``; non-transient 4xx go
straight to the error file), §6.2 (error rows), §6.3 (one row per ``custom_id``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backfill.simulator.server import SimulatorConfig
from tests.support import FAST, Attempt, InProcess, assert_exactly_once, backfill_on, chat_line


async def outcome(
    bf: InProcess, rows: list[dict[str, Any]], timeout_s: float = 90
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``rows`` to a terminal state; return the batch, output rows and error rows."""
    batch = await bf.run_batch(rows, timeout_s=timeout_s)
    out = await bf.rows(batch["output_file_id"])
    err = await bf.rows(batch["error_file_id"])
    return batch, out, err


def by_prompt(attempts: list[Attempt], keep: Callable[[Attempt], bool]) -> dict[str, list[Attempt]]:
    grouped: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in sorted(attempts, key=lambda a: a.started):
        if keep(attempt):
            grouped[attempt.prompt].append(attempt)
    return grouped


async def test_5xx_then_success_ends_in_the_output_file(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST) as (bf, sim):
        rows = [chat_line(f"flaky-{i}", f"[[sim:fail_first=2]] question {i}") for i in range(10)]
        batch, out, err = await outcome(bf, rows)

    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert err == []
    assert_exactly_once(rows, out, err)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    # Each prompt failed twice with 503 and then succeeded: three attempts, no more.
    assert sim.stats.by_status[503] == 20
    assert sim.stats.by_status[200] == 10
    assert sim.stats.requests == 30


async def test_429_is_retried_after_retry_after(tmp_path: Path) -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4, rate_limit_rate=0.3, seed=7)
    attempts: list[Attempt] = []
    async with backfill_on(tmp_path, config, max_attempts=12, attempts=attempts) as (bf, sim):
        rows = [chat_line(f"rl-{i}", f"rate limited question {i}") for i in range(80)]
        batch, out, err = await outcome(bf, rows)

    assert sim.stats.by_status[429] > 0, "the seed should produce some 429 answers"
    assert batch["status"] == "completed"
    assert_exactly_once(rows, out, err)
    assert err == [], f"rows lost to 429 despite 12 attempts: {err[:3]}"
    assert batch["request_counts"] == {"total": 80, "completed": 80, "failed": 0}
    assert sim.stats.requests == 80 + sim.stats.by_status[429]
    # The simulator sends Retry-After: 0.05 with each 429; the configured backoff is 5-10 ms at
    # first, so a retry that comes sooner than Retry-After did not honour it.
    gaps = [
        later.started - earlier.ended
        for tries in by_prompt(attempts, lambda a: a.prompt != "").values()
        for earlier, later in itertools.pairwise(tries)
        if earlier.status == 429
    ]
    assert gaps, "some prompt should have been retried after a 429"
    assert min(gaps) >= 0.045, f"retried {min(gaps):.3f}s after a 429 with Retry-After: 0.05"


async def test_dropped_connections_retry_then_engine_unavailable(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, max_attempts=3) as (bf, sim):
        rows = [chat_line(f"drop-{i}", f"[[sim:drop]] question {i}") for i in range(5)]
        rows += [chat_line(f"ok-{i}", f"fine question {i}") for i in range(5)]
        batch, out, err = await outcome(bf, rows)

    assert batch["status"] == "completed"
    assert_exactly_once(rows, out, err)
    assert sorted(r["custom_id"] for r in out) == [f"ok-{i}" for i in range(5)]
    assert sorted(r["custom_id"] for r in err) == [f"drop-{i}" for i in range(5)]
    for row in err:
        assert row["response"] is None
        assert row["error"]["code"] == "engine_unavailable"
        assert row["error"]["message"]
    assert batch["request_counts"] == {"total": 10, "completed": 5, "failed": 5}
    # Every dropped request was tried max_attempts times; the good ones once.
    assert sim.stats.by_status[0] == 15
    assert sim.stats.requests == 15 + 5


async def test_timeouts_retry_then_request_timeout(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, request_timeout_s=0.5, max_attempts=3) as (bf, sim):
        rows = [chat_line(f"hang-{i}", f"[[sim:hang]] question {i}") for i in range(4)]
        rows += [chat_line(f"ok-{i}", f"fine question {i}") for i in range(4)]
        batch, out, err = await outcome(bf, rows)

    assert batch["status"] == "completed"
    assert_exactly_once(rows, out, err)
    assert sorted(r["custom_id"] for r in out) == [f"ok-{i}" for i in range(4)]
    assert sorted(r["custom_id"] for r in err) == [f"hang-{i}" for i in range(4)]
    for row in err:
        assert row["response"] is None
        assert row["error"]["code"] == "request_timeout"
    assert batch["request_counts"] == {"total": 8, "completed": 4, "failed": 4}
    assert sim.stats.requests == 4 * 3 + 4


async def test_non_transient_400_is_not_retried(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST) as (bf, sim):
        rows = [chat_line(f"bad-{i}", f"[[sim:status=400]] question {i}") for i in range(6)]
        rows += [chat_line(f"ok-{i}", f"fine question {i}") for i in range(4)]
        batch, out, err = await outcome(bf, rows)

    assert batch["status"] == "completed"
    assert_exactly_once(rows, out, err)
    assert sorted(r["custom_id"] for r in err) == [f"bad-{i}" for i in range(6)]
    for row in err:
        assert row["error"] is None
        assert row["response"]["status_code"] == 400
        assert row["response"]["body"] == {
            "error": {"message": "simulated status 400", "type": "simulated", "code": 400}
        }
        assert row["id"].startswith("batch_req_")
    assert batch["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    # One attempt each: a 400 is not worth retrying.
    assert sim.stats.by_status[400] == 6
    assert sim.stats.requests == 10


async def test_mixed_random_faults_every_row_exactly_once(tmp_path: Path) -> None:
    config = SimulatorConfig(
        ttft_ms=1,
        itl_ms=0,
        output_tokens=4,
        error_rate=0.1,
        rate_limit_rate=0.1,
        drop_rate=0.05,
        seed=20240607,
    )
    async with backfill_on(tmp_path, config) as (bf, sim):
        rows = [chat_line(f"mix-{i:03d}", f"mixed question {i}") for i in range(300)]
        batch, out, err = await outcome(bf, rows, timeout_s=120)

    faults = sim.stats.by_status
    assert faults[500] > 0, "the seed should produce 500s"
    assert faults[429] > 0, "the seed should produce 429s"
    assert faults[0] > 0, "the seed should produce dropped connections"
    assert batch["status"] == "completed"
    assert_exactly_once(rows, out, err)
    assert batch["request_counts"] == {"total": 300, "completed": len(out), "failed": len(err)}
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    for row in err:  # only rows unlucky on every attempt; each says why
        if row["response"] is None:
            assert row["error"]["code"] == "engine_unavailable"
        else:
            assert row["response"]["status_code"] in (429, 500)
            assert row["error"] is None
    # Most rows succeed: a row fails only when all five attempts hit a fault.
    assert len(out) >= 290


@pytest.mark.parametrize(
    ("status", "transient"),
    [
        (400, False),
        (401, False),
        (404, False),
        (409, False),
        (413, False),
        (422, False),
        (408, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
    ],
)
async def test_which_engine_statuses_are_retried(
    tmp_path: Path, status: int, transient: bool
) -> None:
    """SPEC §9.2: connection errors, 408, 429, 5xx and timeouts retry; other 4xx do not."""
    async with backfill_on(tmp_path, FAST, max_attempts=3) as (bf, sim):
        rows = [chat_line("only", f"[[sim:status={status}]] question")]
        batch, out, err = await outcome(bf, rows)

    assert batch["status"] == "completed"
    assert out == []
    assert len(err) == 1
    assert err[0]["error"] is None
    assert err[0]["response"]["status_code"] == status
    assert err[0]["response"]["body"]["error"]["message"] == f"simulated status {status}"
    expected = 3 if transient else 1
    assert sim.stats.requests == expected, (
        f"HTTP {status} was sent {sim.stats.requests} times; expected {expected} "
        f"({'transient: retried up to max_attempts' if transient else 'not retried'})"
    )
