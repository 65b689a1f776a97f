"""People's latency budget against batch throughput on one engine: the frontier, and where
Backfill's shared mode sits on it (docs/scheduling.md).

    PYTHONPATH=. python -m bench.frontier --engine sim-flat            # the simulator, GPU-like
    PYTHONPATH=. python -m bench.frontier --engine sim-steep           # the simulator, CPU vLLM
    PYTHONPATH=. python -m bench.frontier --engine vllm --levels 0.3   # the real vLLM (slow)

One engine with 16 sequence slots and priority scheduling serves people: open-loop Poisson
arrivals, streamed, 32-token answers (``bench.interactive_load``), at each level's share of
the engine's capacity (measured first: 16 people at a time, back to back). At each level, in
one run and against the same people schedule:

- **alone**: people and nothing else, the baseline of every ratio;
- **cap N** (1, 2, 4, ... up to the slots): Backfill draining a backlog, ``dedicated`` with
  ``max_concurrency = N`` and ``priority = 10``: the static frontier;
- **shared**: Backfill's shared mode with its default settings (latency budget 1.10).

For each: people's TTFT p99, e2e p50 and e2e p99 against alone, and the batch's requests per
second while people ran. The **oracle** is the best cap whose three ratios are all within the
budget. Targets (issue: spare capacity, for real): shared within the budget, at least 0.9 of
the oracle's throughput, at most 10% of its batch work thrown away (requests given back). A
level of 0 compares shared with dedicated when nobody else is on the engine (target 0.95).

A plot of each level goes to ``docs/frontier-<engine>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
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
from bench.interactive_load import LoadResult, run_interactive_load

SLOTS = 16
TOKENS = 32
PROMPT_WORDS = 30
BUDGET = 1.10
SETTLE_S = 4.0
BATCH_LINES = 20_000


@dataclass
class Engine:
    url: str
    """Ending in /v1."""
    model: str
    """What the engine serves; Backfill's catalog calls it ``MODEL``."""
    stop: Callable[[], None]


def start_engine(kind: str, work: Path) -> Engine:
    if kind == "vllm":
        from bench import vllm

        real = vllm.start_vllm(work / "vllm.log", max_num_seqs=SLOTS, policy="priority")
        return Engine(real.base_url, vllm.SERVED_MODEL, real.stop)
    profile = kind.removeprefix("sim-")
    process, url = start_simulator(
        *("--slots", str(SLOTS)),
        *("--step-profile", profile),
        *("--scheduling-policy", "priority"),
        *("--output-tokens", "4096"),
        *("--model-name", MODEL),
    )
    return Engine(url, MODEL, lambda: stop(process))


def capacity(engine: Engine, seconds: float = 15.0) -> float:
    """People's requests per second with every slot busy, back to back."""

    async def run() -> float:
        done = 0
        deadline = time.perf_counter() + seconds
        body = {
            "model": engine.model,
            "messages": [{"role": "user", "content": " ".join(["word"] * PROMPT_WORDS)}],
            "max_tokens": TOKENS,
        }
        async with aiohttp.ClientSession() as session:

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    async with session.post(engine.url + "/chat/completions", json=body) as r:
                        await r.read()
                    done += 1

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(SLOTS)))
            return done / (time.perf_counter() - start)

    return asyncio.run(run())


@dataclass
class Run:
    name: str
    level: float
    people: LoadResult | None
    batch_rps: float
    given_back: float = 0.0
    completed: int = 0

    def ratios(self, alone: Run) -> tuple[float, float, float]:
        assert self.people is not None
        assert alone.people is not None
        mine, base = self.people, alone.people
        return (
            (mine.ttft.p99 or 0) / (base.ttft.p99 or 1),
            (mine.latency.p50 or 0) / (base.latency.p50 or 1),
            (mine.latency.p99 or 0) / (base.latency.p99 or 1),
        )


def people(engine: Engine, rate: float, count: int, seed: int) -> LoadResult | None:
    return asyncio.run(
        run_interactive_load(
            engine.url,
            rate=rate,
            duration_s=count / rate,
            model=engine.model,
            max_tokens=TOKENS,
            prompt_words=PROMPT_WORDS,
            seed=seed,
        )
    )


# More settings of the shared engine (``--shared``), to try a change against the defaults.
SHARED_EXTRA: list[str] = []


def engine_table(name: str, engine: Engine) -> str:
    served = f'served_names = {{ "{MODEL}" = "{engine.model}" }}\n' if engine.model != MODEL else ""
    if name == "shared":
        shared = f'mode = "shared"\nsignal = "vllm"\nslots = {SLOTS}\npriority = 10\n'
        return served + shared + "\n".join(SHARED_EXTRA)
    return served + "priority = 10"


def with_backfill(
    engine: Engine, work: Path, name: str, cap: int, body: Callable[[], LoadResult | None]
) -> tuple[LoadResult | None, float, float, int]:
    """Backfill up beside ``engine`` (``name``: shared, or a cap), a backlog draining; run
    ``body()`` once it drains; people's result, the batch's rate, requests given back and
    completed meanwhile."""
    source = work / "batch.jsonl"
    if not source.exists():
        with source.open("wb") as out:
            for i in range(BATCH_LINES):
                out.write(request_line(i, TOKENS))
    config = sim_config(work / f"{name}.toml", engine.url, cap, engine=engine_table(name, engine))
    process, base, key = start_backfill(config, work / f"data-{name}", work / f"{name}.log")
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    try:
        batch_id = create_batch(client, upload(client, source))["id"]

        def completed() -> int:
            return int(client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"])

        time.sleep(SETTLE_S)
        before, given_before = completed(), _given_back(client)
        start = time.perf_counter()
        result = body()
        elapsed = time.perf_counter() - start
        done = completed() - before
        given = _given_back(client) - given_before
        client.post(f"/v1/batches/{batch_id}/cancel", json={})
        return result, done / elapsed, given, done
    finally:
        client.close()
        stop(process)


def _given_back(client: httpx.Client) -> float:
    page = client.get("/metrics").text
    found = re.findall(r"^backfill_engine_given_back_total{[^}]*} (\S+)$", page, re.M)
    return sum(float(v) for v in found)


def caps() -> list[int]:
    out, cap = [], 1
    while cap < SLOTS:
        out.append(cap)
        cap *= 2
    return [*out, SLOTS]


def run_level(engine: Engine, work: Path, level: float, cap_rps: float, count: int) -> list[Run]:
    if level == 0:
        idle_s = 20.0
        runs = []
        for name, cap in (("dedicated", SLOTS), ("shared", SLOTS)):
            _, rps, given, done = with_backfill(
                engine,
                work,
                name if name == "shared" else f"cap{cap}",
                cap,
                lambda: time.sleep(idle_s),
            )
            runs.append(Run(name, 0.0, None, rps, given, done))
        return runs
    rate = level * cap_rps
    seed = int(level * 100)
    # A warm-up at the level's rate first: a real engine's first batches of a new size are
    # slow (a first run on vLLM's CPU build gave people alone a TTFT p99 of 2.5 s), and the
    # baseline of every ratio must not carry that.
    people(engine, rate, max(20, count // 5), seed + 1)
    runs = [Run("alone", level, people(engine, rate, count, seed), 0.0)]
    for cap in caps():
        result, rps, given, done = with_backfill(
            engine, work, f"cap{cap}", cap, lambda: people(engine, rate, count, seed)
        )
        runs.append(Run(f"cap {cap}", level, result, rps, given, done))
    result, rps, given, done = with_backfill(
        engine, work, "shared", SLOTS, lambda: people(engine, rate, count, seed)
    )
    runs.append(Run("shared", level, result, rps, given, done))
    return runs


def report(runs: list[Run]) -> None:
    if runs[0].level == 0:
        dedicated, shared = runs
        print(
            f"\nnobody else: dedicated {dedicated.batch_rps:.2f} req/s, shared "
            f"{shared.batch_rps:.2f} ({shared.batch_rps / max(dedicated.batch_rps, 1e-9):.2f}x)"
        )
        return
    alone = runs[0]
    assert alone.people is not None
    base = alone.people
    ttft, p50, p99 = (1000 * (x or 0) for x in (base.ttft.p99, base.latency.p50, base.latency.p99))
    print(
        f"\nlevel {alone.level:.0%}: {base.ok} people alone, TTFT p99 {ttft:.0f} ms, "
        f"e2e p50/p99 {p50:.0f}/{p99:.0f} ms"
    )
    print(f"{'run':10} {'TTFT p99':>9} {'e2e p50':>8} {'e2e p99':>8} {'batch/s':>8}  given back")
    oracle: Run | None = None
    for run in runs[1:]:
        r = run.ratios(alone)
        within = all(x <= BUDGET for x in r)
        if (
            run.name.startswith("cap")
            and within
            and (oracle is None or run.batch_rps > oracle.batch_rps)
        ):
            oracle = run
        thrown = run.given_back / max(1.0, run.completed + run.given_back)
        print(
            f"{run.name:10} {r[0]:8.2f}x {r[1]:7.2f}x {r[2]:7.2f}x {run.batch_rps:8.2f}  "
            f"{run.given_back:.0f} ({thrown:.0%}){'  within' if within else ''}"
        )
    shared = runs[-1]
    best = oracle.batch_rps if oracle else 0.0
    print(
        f"oracle: {oracle.name if oracle else 'none within the budget'} ({best:.2f} req/s); "
        f"shared {shared.batch_rps:.2f} req/s = "
        f"{shared.batch_rps / best:.2f}x"
        if best
        else ""
    )


def plot(levels: list[list[Run]], path: Path, title: str) -> None:
    shown = [runs for runs in levels if runs[0].level > 0]
    if not shown:
        return
    fig = Figure(figsize=(5 * len(shown), 4))
    for i, runs in enumerate(shown):
        ax = fig.add_subplot(1, len(shown), i + 1)
        alone = runs[0]
        for run in runs[1:]:
            slowdown = max(run.ratios(alone))
            marker, color = ("*", "tab:red") if run.name == "shared" else ("o", "tab:blue")
            ax.scatter(
                [slowdown],
                [run.batch_rps],
                marker=marker,
                color=color,
                s=120 if marker == "*" else 40,
            )
            ax.annotate(
                run.name,
                (slowdown, run.batch_rps),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.axvline(BUDGET, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("people's worst slowdown (TTFT p99, e2e p50, e2e p99 vs alone)")
        ax.set_ylabel("batch requests/s")
        ax.set_title(f"{title}: people at {alone.level:.0%} of capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="sim-flat", choices=["sim-flat", "sim-steep", "vllm"])
    parser.add_argument("--levels", default="0,0.3,0.6,0.9")
    parser.add_argument("--people", type=int, default=600, help="people per run")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--shared", action="append", default=[], help="a shared engine setting")
    args = parser.parse_args()
    SHARED_EXTRA.extend(args.shared)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = start_engine(args.engine, work)
        try:
            cap_rps = capacity(engine)
            print(f"{args.engine}: capacity {cap_rps:.2f} people/s at {SLOTS} slots")
            levels = [
                run_level(engine, work, float(x), cap_rps, args.people)
                for x in args.levels.split(",")
            ]
            for runs in levels:
                report(runs)
            plot(levels, args.plot or Path("docs") / f"frontier-{args.engine}.png", args.engine)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
