"""A shared engine: interactive latency and batch throughput, Backfill dedicated vs shared.

    PYTHONPATH=. python -m bench.shared_engine                    # about 7 minutes
    PYTHONPATH=. python -m bench.shared_engine --window 8 --levels 0.3,0.9   # a quick look

One simulated continuous-batching engine with 64 sequence slots (``backfill simulate
--slots 64``) serves open-loop interactive traffic (Poisson arrivals, streamed, from
``bench.interactive_load``) at 30%, 60% and 90% of its capacity, four ways in one run:

- **alone**: the interactive load and nothing else — the baseline;
- **dedicated**: beside Backfill draining a 50,000-request batch with the engine configured
  ``dedicated`` (filled up to ``max_concurrency`` = the engine's 64 slots);
- **shared**: the same with the engine ``shared`` (batch work follows the engine's vLLM
  metrics and takes only what the interactive load leaves; docs/scheduling.md);
- **priority**: ``shared`` with ``priority = 10``: the engine runs vLLM's priority scheduling
  (``--scheduling-policy priority``), so people's requests (priority 0) go ahead of
  Backfill's in the engine's waiting queue (they preempt nothing: vLLM V1 preempts only for
  KV blocks), and Backfill keeps no headroom free. Where every request has the same
  priority (the other modes), that engine is first come, first served.

Each level runs for ``--window`` seconds after a short settling time. Interactive p50/p99
time to first token is compared with its value alone; batch throughput with the capacity the
interactive load leaves free (the batch's drain rate with no interactive traffic, times the
free share). The batch is a backlog that does not finish inside the run; its rate is read
from ``request_counts`` at the start and end of each window. A plot goes to
``docs/shared_engine.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from matplotlib.figure import Figure

from bench.common import (
    MODEL,
    create_batch,
    request_line,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
    upload,
)
from bench.interactive_load import run_interactive_load

SLOTS = 64
BATCH_REQUESTS = 50_000
BATCH_TOKENS = 16
# The engine: a step of 20 ms alone, up to 30 ms with every slot busy, plus 0.1 ms per prompt
# word prefilled in it; 10 ms in the API server before a request reaches the engine's queue.
ITL_MS, ITL_GROWTH, TTFT_MS, PREFILL_MS = 20.0, 0.5, 10.0, 0.1
INTERACTIVE_TOKENS = 32
INTERACTIVE_PROMPT_WORDS = 120
SETTLE_S = 3.0


def simulator_args() -> list[str]:
    return [
        *("--slots", str(SLOTS)),
        *("--itl-ms", str(ITL_MS)),
        *("--itl-growth", str(ITL_GROWTH)),
        *("--ttft-ms", str(TTFT_MS)),
        *("--prefill-ms-per-token", str(PREFILL_MS)),
        *("--output-tokens", "256"),
        *("--model-name", MODEL),
        *("--scheduling-policy", "priority"),
    ]


def interactive_rate(level: float) -> float:
    """Arrivals per second that keep ``level`` of the slots busy with interactive requests
    (Little's law, with the decode step at that occupancy)."""
    step_s = ITL_MS * (1 + ITL_GROWTH * level) / 1000
    service_s = (TTFT_MS + PREFILL_MS * INTERACTIVE_PROMPT_WORDS) / 1000
    service_s += INTERACTIVE_TOKENS * step_s
    return level * SLOTS / service_s


@dataclass(frozen=True)
class Row:
    mode: str
    level: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    interactive: int
    batch_rps: float


class BatchWatch:
    """Backfill up with the engine in one mode, draining one big batch."""

    def __init__(self, base: str, key: str, batch_id: str) -> None:
        self._client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        self.batch_id = batch_id

    def completed(self) -> int:
        batch = self._client.get(f"/v1/batches/{self.batch_id}").json()
        return int(batch["request_counts"]["completed"])

    def cancel(self) -> None:
        self._client.post(f"/v1/batches/{self.batch_id}/cancel", json={})


def start_batch(base: str, key: str, source: Path) -> BatchWatch:
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    batch = create_batch(client, upload(client, source))
    return BatchWatch(base, key, batch["id"])


def measure(url: str, mode: str, level: float, window_s: float, watch: BatchWatch | None) -> Row:
    """One level: interactive load for the window (after settling), the batch's rate in it."""
    rate = interactive_rate(level)
    if level > 0:
        asyncio.run(
            run_interactive_load(
                url,
                rate=rate,
                duration_s=SETTLE_S,
                max_tokens=INTERACTIVE_TOKENS,
                prompt_words=INTERACTIVE_PROMPT_WORDS,
                model=MODEL,
            )
        )
    else:
        time.sleep(SETTLE_S)
    before = watch.completed() if watch else 0
    start = time.perf_counter()
    if level > 0:
        result = asyncio.run(
            run_interactive_load(
                url,
                rate=rate,
                duration_s=window_s,
                max_tokens=INTERACTIVE_TOKENS,
                prompt_words=INTERACTIVE_PROMPT_WORDS,
                model=MODEL,
                seed=int(level * 100),
            )
        )
        p50 = 1000 * (result.ttft.p50 or 0.0)
        p99 = 1000 * (result.ttft.p99 or 0.0)
        count = result.ok
    else:
        time.sleep(window_s)
        p50 = p99 = 0.0
        count = 0
    elapsed = time.perf_counter() - start
    batch_rps = (watch.completed() - before) / elapsed if watch else 0.0
    return Row(mode, level, p50, p99, count, batch_rps)


def run_mode(
    mode: str,
    url: str,
    work: Path,
    source: Path,
    levels: list[float],
    window_s: float,
    tuning: str = "",
    extra: str = "",
) -> list[Row]:
    engine = _engine_settings(mode) + ("\n" + tuning if mode != "dedicated" else "")
    config = sim_config(work / f"{mode}.toml", url, SLOTS, extra=extra, engine=engine)
    process, base, key = start_backfill(config, work / f"data-{mode}", work / f"{mode}.log")
    try:
        watch = start_batch(base, key, source)
        rows = [measure(url, mode, level, window_s, watch) for level in [0.0, *levels]]
        watch.cancel()
        return rows
    finally:
        stop(process)


def _engine_settings(mode: str) -> str:
    if mode == "dedicated":
        return 'mode = "dedicated"'
    shared = f'mode = "shared"\nsignal = "vllm"\nslots = {SLOTS}'
    return shared + "\npriority = 10" if mode == "priority" else shared


def plot(rows: list[Row], path: Path) -> None:
    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    for mode, marker in (("alone", "o"), ("dedicated", "s"), ("shared", "^"), ("priority", "D")):
        points = sorted((r.level, r) for r in rows if r.mode == mode and r.level > 0)
        if points:
            levels = [100 * level for level, _ in points]
            left.plot(levels, [r.ttft_p99_ms for _, r in points], marker=marker, label=mode)
    alone = sorted((r.level, r.ttft_p99_ms) for r in rows if r.mode == "alone")
    if alone:
        left.plot(
            [100 * level for level, _ in alone],
            [1.1 * v for _, v in alone],
            linestyle="--",
            color="grey",
            label="1.10x alone (target)",
        )
    left.set_xlabel("interactive load (% of the engine's capacity)")
    left.set_ylabel("interactive p99 time to first token (ms)")
    left.set_yscale("log")
    left.grid(True, alpha=0.3)
    left.legend(loc="best")
    free = {r.level: r.batch_rps for r in rows if r.mode == "dedicated" and r.level == 0}
    capacity = free.get(0.0, 0.0)
    for mode, marker in (("dedicated", "s"), ("shared", "^"), ("priority", "D")):
        rates = sorted((r.level, r.batch_rps) for r in rows if r.mode == mode)
        right.plot([100 * lv for lv, _ in rates], [v for _, v in rates], marker=marker, label=mode)
    if capacity:
        xs = [0, 30, 60, 90]
        right.plot(
            xs,
            [0.8 * capacity * (1 - x / 100) for x in xs],
            linestyle="--",
            color="grey",
            label="0.8x the free capacity (target)",
        )
    right.set_xlabel("interactive load (% of the engine's capacity)")
    right.set_ylabel("batch requests/s")
    right.grid(True, alpha=0.3)
    right.legend(loc="best")
    fig.suptitle(f"One engine, {SLOTS} slots: interactive traffic beside a Backfill batch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def report(rows: list[Row]) -> None:
    alone = {r.level: r for r in rows if r.mode == "alone"}
    capacity = next((r.batch_rps for r in rows if r.mode == "dedicated" and r.level == 0), 0.0)
    print(
        f"engine: {SLOTS} slots; batch: {BATCH_REQUESTS:,} requests of {BATCH_TOKENS} tokens; "
        f"interactive: {INTERACTIVE_TOKENS} tokens, streamed, Poisson"
    )
    print(
        f"{'mode':<10} {'load':>5} {'rate/s':>7} {'TTFT p50':>9} {'p99':>8} {'p99/alone':>9} "
        f"{'batch/s':>8} {'of free':>7}"
    )
    for r in rows:
        base = alone.get(r.level)
        ratio = f"{r.ttft_p99_ms / base.ttft_p99_ms:.2f}x" if base and r.level > 0 else "-"
        free = capacity * (1 - r.level)
        share = f"{r.batch_rps / free:.2f}" if free and r.mode != "alone" else "-"
        ttft = f"{r.ttft_p50_ms:9.1f} {r.ttft_p99_ms:8.1f}" if r.level > 0 else f"{'-':>9} {'-':>8}"
        print(
            f"{r.mode:<10} {100 * r.level:4.0f}% {interactive_rate(r.level):7.1f} {ttft} "
            f"{ratio:>9} {r.batch_rps:8.1f} {share:>7}"
        )
    for mode in ("shared", "priority"):
        idle = next((r.batch_rps for r in rows if r.mode == mode and r.level == 0), None)
        if capacity and idle is not None:
            print(
                f"no interactive traffic: {mode} drains at {idle / capacity:.2f}x of "
                "dedicated (target >= 0.95x)"
            )
    print("targets for shared: p99/alone <= 1.10x at every load; 'of free' >= 0.80")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=20.0, help="seconds per load level")
    parser.add_argument("--levels", default="0.3,0.6,0.9")
    parser.add_argument("--modes", default="alone,dedicated,shared,priority")
    parser.add_argument(
        "--plot",
        type=lambda s: Path(s) if s else None,
        default=Path("docs/shared_engine.png"),
        help='where the PNG goes; "" for none',
    )
    parser.add_argument("--extra", default="", help="more top-level settings of Backfill")
    parser.add_argument(
        "--tuning", default="", help='more settings of the shared engine, e.g. "headroom = 4"'
    )
    args = parser.parse_args()
    levels = [float(x) for x in args.levels.split(",")]
    modes = args.modes.split(",")
    engine, url = start_simulator(*simulator_args())
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            source = work / "input.jsonl"
            source.write_bytes(
                b"".join(request_line(i, BATCH_TOKENS) for i in range(BATCH_REQUESTS))
            )
            if "alone" in modes:
                rows += [measure(url, "alone", level, args.window, None) for level in levels]
            for mode in ("dedicated", "shared", "priority"):
                if mode in modes:
                    rows += run_mode(
                        mode, url, work, source, levels, args.window, args.tuning, args.extra
                    )
    finally:
        stop(engine)
    report(rows)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
