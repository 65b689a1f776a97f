"""A million-line batch drains at a steady rate: throughput per 5% of progress.

    PYTHONPATH=. python -m bench.drain_curve [--requests 1000000] [--concurrency 512]
        [--plot docs/drain_curve.png] [--csv samples.csv] [--keep]

One batch of ``--requests`` tiny chat-completion lines (max_tokens 16) runs through
``backfill up`` (embedded, SQLite) against the simulator (TTFT 50 ms, 1 ms per token), the
engine allowing ``--concurrency`` requests in flight. At that concurrency the engine could
answer several thousand requests a second, so the rate measured is Backfill's own. From the
moment the batch is created, GET /v1/batches/{id} is polled with 0.5 s between polls (about
one a second while the server is busy) and ``completed + failed`` recorded against a monotonic
clock, with the server's CPU seconds and RSS read from /proc at the same moment.

The baseline is the same run's first 10% of lines: each 5% of progress is shown as a rate
and a ratio against it, and the acceptance figure is the rate over the last 10% against the
first 10% (target >= 0.9x). A queue whose work grows with the lines already finished shows
up here as a falling curve, which a short batch or a whole-run average hides. The rates run
from the drain's first finished lines; creating the batch and the first claim are shown apart.
CPU per 1,000 lines, first 10% against last 10%, shows the same trend and, unlike the rate,
hardly moves when other work shares the machine.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx

# The Figure API, not pyplot: it renders straight to the file, with no GUI backend or global
# state to choose, which a server without a display lacks anyway.
from matplotlib.figure import Figure

from bench.common import (
    cpu_seconds,
    create_batch,
    multipart,
    peak_rss_mb,
    short_line,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
)

POLL_S = 0.5
# Until the first line is done and near the end the poll tightens to this, so the start of the
# drain and the moment the last line lands are known within it, not within POLL_S: the first
# and last 10% of a 50,000-line batch last only a few seconds, and a late sample at either end
# would read as a slower rate there.
FAST_POLL_S = 0.05
# A batch whose counts and status stay the same this long is given up on (the script exits
# nonzero); finalizing a million lines counts nothing for a while, hence the margin.
STALL_S = 600.0
BUCKETS = 20  # 5% each
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class Sample:
    t_s: float  # since batch creation was requested, monotonic
    completed: int
    failed: int
    status: str
    cpu_s: float  # the Backfill process's CPU seconds since batch creation
    rss_mb: float

    @property
    def done(self) -> int:
        return self.completed + self.failed


def write_lines(path: Path, n: int) -> int:
    # Streamed line by line: a million lines held as a list would cost the benchmark
    # hundreds of MB for nothing.
    with path.open("wb") as out:
        for i in range(n):
            out.write(short_line(i))
    return path.stat().st_size


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def drain(
    client: httpx.Client, pid: int, file_id: str, total: int
) -> tuple[list[Sample], float, float]:
    """Create the batch and sample its progress until it ends.

    Returns the samples (t = 0 is when the creation was asked for; the second sample is its
    answer), the CPU seconds at the end, and the time the batch reached a terminal status.
    """
    cpu_before = cpu_seconds(pid)
    rss_before = rss_mb(pid)
    start = time.monotonic()
    # Creating a large batch takes seconds, so its answer is a sample of its own, at the time
    # it came back; the one at t = 0 (nothing done, nothing known) only anchors the first.
    batch = create_batch(client, file_id)
    batch_id = batch["id"]
    counts = batch["request_counts"]
    samples = [
        Sample(0.0, 0, 0, "", 0.0, rss_before),
        Sample(
            time.monotonic() - start,
            counts["completed"],
            counts["failed"],
            batch["status"],
            cpu_seconds(pid) - cpu_before,
            rss_mb(pid),
        ),
    ]
    last_progress = start
    while True:
        prev = samples[-1]
        wait = FAST_POLL_S if prev.done == 0 else POLL_S
        if len(samples) >= 2:
            before = samples[-2]
            rate = (prev.done - before.done) / max(prev.t_s - before.t_s, 1e-9)
            if rate > 0 and (total - prev.done) / rate < 2 * POLL_S:
                wait = FAST_POLL_S
        time.sleep(wait)
        sent = time.monotonic()
        response = client.get(f"/v1/batches/{batch_id}")
        answered = time.monotonic()
        response.raise_for_status()
        batch = response.json()
        counts = batch["request_counts"]
        # The counts were read somewhere inside the request; its midpoint is the best guess.
        sample = Sample(
            (sent + answered) / 2 - start,
            counts["completed"],
            counts["failed"],
            batch["status"],
            cpu_seconds(pid) - cpu_before,
            rss_mb(pid),
        )
        samples.append(sample)
        if sample.status in TERMINAL:
            return samples, sample.cpu_s, sample.t_s
        if sample.done > prev.done or sample.status != prev.status:
            last_progress = answered
        elif answered - last_progress > STALL_S:
            raise RuntimeError(f"no progress for {STALL_S:.0f} s: {batch['status']} {counts}")


def crossing(samples: list[Sample], mark: float) -> tuple[float, float]:
    """(time, CPU seconds) at which ``done`` reached ``mark``, interpolated between samples."""
    for before, after in pairwise(samples):
        if after.done >= mark > before.done:
            share = (mark - before.done) / (after.done - before.done)
            return (
                before.t_s + share * (after.t_s - before.t_s),
                before.cpu_s + share * (after.cpu_s - before.cpu_s),
            )
    raise ValueError(f"progress never reached {mark}")


def plot(path: Path, centres: list[float], rates: list[float], first: float, n: int) -> None:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ax.plot(centres, rates, marker="o", label="rate per 5% of progress")
    ax.axhline(0.9 * first, linestyle="--", color="grey", label="0.9x the rate over the first 10%")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, max(*rates, first) * 1.15)
    ax.set_xlabel("progress (% of lines done)")
    ax.set_ylabel("lines/s")
    ax.set_title(f"Drain rate of one {n:,}-line batch")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def write_csv(path: Path, samples: list[Sample]) -> None:
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["t_s", "completed", "failed", "done", "status", "cpu_s", "rss_mb"])
        for s in samples:
            out.writerow(
                [
                    f"{s.t_s:.3f}",
                    s.completed,
                    s.failed,
                    s.done,
                    s.status,
                    f"{s.cpu_s:.2f}",
                    f"{s.rss_mb:.1f}",
                ]
            )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--plot", type=Path, default=Path("docs/drain_curve.png"))
    parser.add_argument("--csv", type=Path, default=None, help="write the raw samples here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    total: int = args.requests
    if total < BUCKETS:
        parser.error(f"--requests must be at least {BUCKETS}")

    work = Path(tempfile.mkdtemp(prefix="backfill-drain-curve-"))
    engine, url = start_simulator("--ttft-ms", "50", "--itl-ms", "1", "--output-tokens", "64")
    try:
        source = work / "input.jsonl"
        size_mib = write_lines(source, total) / (1 << 20)
        config = sim_config(work / "bench.toml", url, args.concurrency)
        process, base, key = start_backfill(config, work / "data", work / "server.log")
        try:
            client = httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900
            )
            body, content_type = multipart(source)
            uploaded = client.post(
                "/v1/files", content=body, headers={"Content-Type": content_type}
            )
            uploaded.raise_for_status()
            samples, cpu, end_s = drain(client, process.pid, uploaded.json()["id"], total)
            peak = peak_rss_mb(process.pid)
        finally:
            stop(process)
    finally:
        stop(engine)
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    if args.csv:
        write_csv(args.csv, samples)
    final = samples[-1]
    print(f"batch: {total:,} lines ({size_mib:.0f} MiB), concurrency {args.concurrency}")
    if final.status != "completed" or final.done != total:
        print(
            f"the batch ended {final.status} with {final.completed} completed and "
            f"{final.failed} failed of {total}",
            file=sys.stderr,
        )
        return 1

    # The rates run from the last sample with nothing done: the time before it (creating the
    # batch, seconds for a large one; the first claim; the first requests' latency) is a fixed
    # start-up cost that would slow the first 10% and so flatter the ratio; it is shown apart.
    idle = [s for s in samples if s.done == 0][-1]
    start_s = idle.t_s
    marks = [(start_s, idle.cpu_s)]
    marks += [crossing(samples, total * k / BUCKETS) for k in range(1, BUCKETS + 1)]
    step = total / BUCKETS
    tenth = BUCKETS // 10
    first = tenth * step / (marks[tenth][0] - marks[0][0])
    last = tenth * step / (marks[-1][0] - marks[-1 - tenth][0])
    last_line_s = marks[-1][0]
    # CPU per line barely moves when other work shares the machine, unlike the wall-clock rate:
    # a second view of the same trend.
    cpu_first = (marks[tenth][1] - marks[0][1]) / (tenth * step) * 1000
    cpu_last = (marks[-1][1] - marks[-1 - tenth][1]) / (tenth * step) * 1000
    print(f"{'progress':>10}  {'lines/s':>9}  {'vs first 10%':>12}  {'CPU s / 1,000 lines':>19}")
    centres: list[float] = []
    rates: list[float] = []
    for k in range(BUCKETS):
        (t0, c0), (t1, c1) = marks[k], marks[k + 1]
        rate = step / (t1 - t0)
        centres.append((k + 0.5) * 100 / BUCKETS)
        rates.append(rate)
        span = f"{k * 100 // BUCKETS}-{(k + 1) * 100 // BUCKETS}%"
        print(f"{span:>10}  {rate:9.1f}  {rate / first:11.2f}x  {(c1 - c0) / step * 1000:19.3f}")
    print(f"first 10%           : {first:8.1f} lines/s  1.00x")
    print(
        f"last 10%            : {last:8.1f} lines/s  {last / first:.2f}x  "
        f"(target >= 0.9x: {'met' if last / first >= 0.9 else 'MISSED'})"
    )
    print(
        f"CPU / 1,000 lines   : {cpu_first:8.3f} s over the first 10%, {cpu_last:.3f} s over the "
        f"last 10% ({cpu_last / cpu_first:.2f}x)"
    )
    print(
        f"start-up            : {start_s:8.2f} s  (creating the batch: {samples[1].t_s:.2f} s; "
        "left out of the rates)"
    )
    print(
        f"total               : {end_s:8.1f} s  (last line at {last_line_s:.1f} s, "
        f"then {end_s - last_line_s:.1f} s to finalize)"
    )
    print(
        f"overall rate        : {total / end_s:8.1f} lines/s  (to the last line: "
        f"{total / last_line_s:.1f} lines/s)"
    )
    print(f"backfill CPU        : {cpu:8.1f} s  {cpu / total * 1000:.3f} s per 1,000 lines")
    # The peak includes the upload; the highest sample shows whether the drain itself grows.
    drain_peak = max(s.rss_mb for s in samples)
    print(
        f"backfill peak RSS   : {peak:8.0f} MB  (during the drain, sampled: {drain_peak:.0f} MB; "
        f"at the end: {final.rss_mb:.0f} MB)"
    )
    plot(args.plot, centres, rates, first, total)
    print(f"plot: {args.plot}")
    if args.csv:
        print(f"samples: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
