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
  ``max_concurrency = N`` and ``priority = 10``: the static frontier (larger caps are skipped
  once one has slowed people down ``CAP_STOP`` times);
- **shared**: Backfill's shared mode with its default settings (latency budget 1.10).

People are on the engine first; the batch arrives ``LEAD_S`` later, as it would on an engine
in service, and people are measured from ``SETTLE_S`` after that: the frontier is a steady
state. How fast shared mode gets out of people's way when they come in a rush is the
**step** level: people at 30% of capacity jump to 90% for 10 s on an engine full of batch
work; its figure is the time from the jump until people's latency (TTFT and end to end, the
mean over a window) is back within the budget of the same burst alone, against one batch
request's duration on a full engine (the target: at most that).

For each: people's TTFT p99, e2e p50 and e2e p99 against alone, the batch's requests per
second while people ran, and how Backfill held the engine meanwhile (its requests in flight
and its limit, sampled from its /metrics). ``--caps 2,4`` runs only those caps; ``--looks 0.1``
adds a shared run that reads the engine's metrics that often, beside the default.

The **oracle** is the best cap whose three ratios are all within the budget. Targets (issue:
spare capacity, for real): shared within the budget, at least 0.9 of the oracle's
throughput, at most 10% of its batch work thrown away (requests given back). A level of 0
compares shared with dedicated when nobody else is on the engine (target 0.95).

A plot of each level goes to ``docs/frontier-<engine>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from matplotlib.figure import Figure

from backfill.settings import EngineSettings
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
LEAD_S = 3.0
"""People alone on the engine before the batch arrives."""
SETTLE_S = 4.0
"""The batch beside people this long before they are measured."""
BATCH_LINES = 20_000
CAP_STOP = 2.0
IDLE_S = 20.0
"""Level 0: how long the batch's rate is measured with nobody else on the engine."""
IDLE_AFTER_S: float = EngineSettings.model_fields["idle_after_s"].default
"""Shared mode's default ``idle_after_s``, counted from its first look at the engine (after
the priority probe): level 0 is measured from this much later than the others, at the steady
state it describes. Measured from ``SETTLE_S`` alone, the real vLLM's window held the start
and gave 0.85x where the steady state gave 1.02x (docs/performance.md)."""
STEP_RATES = (0.3, 0.9)
STEP_S = 10.0
"""The step level: people at the first share of capacity, then the second for this long, then
the first again as long."""


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

        # Every run replays the same people and the same batch lines: with its prefix cache
        # on, vLLM would answer the later runs from what the first one left in it.
        real = vllm.start_vllm(
            work / "vllm.log",
            max_num_seqs=SLOTS,
            policy="priority",
            extra=["--no-enable-prefix-caching"],
        )
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
    held: Held | None = None

    def ratios(self, alone: Run) -> tuple[float, float, float]:
        assert self.people is not None
        assert alone.people is not None
        mine, base = self.people, alone.people
        return (
            (mine.ttft.p99 or 0) / (base.ttft.p99 or 1),
            (mine.latency.p50 or 0) / (base.latency.p50 or 1),
            (mine.latency.p99 or 0) / (base.latency.p99 or 1),
        )


@dataclass
class Held:
    """Backfill's requests in flight on the engine and its limit, sampled from its /metrics
    every ``HELD_EVERY_S`` while people were measured: how it held its slots, beyond the mean
    its throughput shows (a cap that swings between 0 and 4 slows people more than 2 held)."""

    in_flight: list[float]
    limit: list[float]
    people: list[float]
    """People on the engine as shared mode saw them (its pressure; 0 for a cap)."""

    def summary(self) -> str:
        if not self.in_flight:
            return ""
        q = statistics.quantiles(self.in_flight, n=10) if len(self.in_flight) > 1 else [0.0] * 9
        return (
            f"in flight mean {statistics.fmean(self.in_flight):.2f} "
            f"(p10 {q[0]:.0f}, p50 {q[4]:.0f}, p90 {q[8]:.0f}), "
            f"limit mean {statistics.fmean(self.limit):.2f}, "
            f"people seen mean {statistics.fmean(self.people):.2f}"
        )


HELD_EVERY_S = 0.25


def _gauge(page: str, name: str) -> float:
    found = re.findall(rf"^{name}{{[^}}]*}} (\S+)$", page, re.M)
    return sum(float(v) for v in found)


class HeldSampler:
    """Samples ``Held`` on a thread until stopped."""

    def __init__(self, base: str, key: str) -> None:
        self._client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        self._stop = threading.Event()
        self.held = Held([], [], [])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HELD_EVERY_S):
            try:
                page = self._client.get("/metrics").text
            except httpx.HTTPError:
                continue
            self.held.in_flight.append(_gauge(page, "backfill_engine_in_flight"))
            self.held.limit.append(_gauge(page, "backfill_engine_concurrency_limit"))
            self.held.people.append(_gauge(page, "backfill_engine_pressure"))

    def stop(self) -> Held:
        self._stop.set()
        self._thread.join()
        self._client.close()
        return self.held


@dataclass(frozen=True)
class People:
    """One schedule of people: ``(seconds, rate)`` phases, the same in every run of a level."""

    phases: list[tuple[float, float]]
    seed: int

    def run(self, engine: Engine) -> LoadResult:
        return asyncio.run(
            run_interactive_load(
                engine.url,
                phases=self.phases,
                model=engine.model,
                max_tokens=TOKENS,
                prompt_words=PROMPT_WORDS,
                seed=self.seed,
            )
        )


# More settings of the shared engine (``--shared``), to try a change against the defaults.
SHARED_EXTRA: list[str] = []
# Shared runs beside the default one, each looking at the engine's metrics this often
# (``--looks``), by run name: what the looks themselves cost people.
LOOKS_AT: dict[str, float] = {}


def engine_table(name: str, engine: Engine) -> str:
    served = f'served_names = {{ "{MODEL}" = "{engine.model}" }}\n' if engine.model != MODEL else ""
    if name.startswith("shared"):
        shared = f'mode = "shared"\nsignal = "vllm"\nslots = {SLOTS}\npriority = 10\n'
        return served + shared + "\n".join(SHARED_EXTRA)
    return served + "priority = 10"


def with_backfill(
    engine: Engine, work: Path, name: str, cap: int, people: People | None
) -> tuple[LoadResult | None, float, float, int, Held]:
    """Backfill up beside ``engine`` (``name``: shared, or a cap) with a backlog to drain:
    ``people`` run from before it arrives (None: nobody, for ``IDLE_S``). People's result
    from ``LEAD_S + SETTLE_S`` on, the batch's rate meanwhile, requests given back and
    completed meanwhile, and how Backfill held the engine's slots meanwhile."""
    source = work / "batch.jsonl"
    if not source.exists():
        with source.open("wb") as out:
            for i in range(BATCH_LINES):
                out.write(request_line(i, TOKENS))
    looks = LOOKS_AT.get(name)
    extra = f"worker.pressure_interval_s = {looks}" if looks else ""
    config = sim_config(
        work / f"{name}.toml", engine.url, cap, extra, engine=engine_table(name, engine)
    )
    process, base, key = start_backfill(config, work / f"data-{name}", work / f"{name}.log")
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    try:
        file_id = upload(client, source)
        with ThreadPoolExecutor(1) as pool:
            began = time.perf_counter()
            running = pool.submit(people.run, engine) if people else None
            _sleep_until(began + (LEAD_S if people else 0.0))
            batch_id = create_batch(client, file_id)["id"]

            def completed() -> int:
                counts = client.get(f"/v1/batches/{batch_id}").json()["request_counts"]
                return int(counts["completed"])

            measured_from = LEAD_S + SETTLE_S if people else SETTLE_S + IDLE_AFTER_S
            _sleep_until(began + measured_from)
            before, given_before = completed(), _given_back(client)
            sampler = HeldSampler(base, key)
            start = time.perf_counter()
            result = running.result().between(measured_from) if running else None
            if running is None:
                time.sleep(IDLE_S)
            elapsed = time.perf_counter() - start
            held = sampler.stop()
        done = completed() - before
        given = _given_back(client) - given_before
        client.post(f"/v1/batches/{batch_id}/cancel", json={})
        return result, done / elapsed, given, done, held
    finally:
        client.close()
        stop(process)


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.perf_counter()))


def _given_back(client: httpx.Client) -> float:
    return _gauge(client.get("/metrics").text, "backfill_engine_given_back_total")


CAPS: list[int] = []
"""The static caps each level runs (``--caps``); empty: 1, 2, 4, ... up to the slots."""


def caps() -> list[int]:
    if CAPS:
        return CAPS
    out, cap = [], 1
    while cap < SLOTS:
        out.append(cap)
        cap *= 2
    return [*out, SLOTS]


def warm_up(engine: Engine, rate: float, count: int, seed: int) -> None:
    """People at the level's rate, not measured: a real engine's first batches of a new size
    are slow (a first run on vLLM's CPU build gave people alone a TTFT p99 of 2.5 s), and the
    baseline of every ratio must not carry that."""
    People([(max(20, count // 5) / rate, rate)], seed).run(engine)


def run_level(engine: Engine, work: Path, level: float, cap_rps: float, count: int) -> list[Run]:
    if level == 0:
        runs = []
        for name, cap in (("dedicated", SLOTS), ("shared", SLOTS)):
            label = name if name == "shared" else f"cap{cap}"
            _, rps, given, done, held = with_backfill(engine, work, label, cap, None)
            runs.append(Run(name, 0.0, None, rps, given, done, held))
        return runs
    rate = level * cap_rps
    seed = int(level * 100)
    people = People([(LEAD_S + SETTLE_S + count / rate, rate)], seed)
    warm_up(engine, rate, count, seed + 1)
    alone = Run("alone", level, people.run(engine).between(LEAD_S + SETTLE_S), 0.0)
    runs = [alone]
    for cap in caps():
        result, rps, given, done, held = with_backfill(engine, work, f"cap{cap}", cap, people)
        runs.append(Run(f"cap {cap}", level, result, rps, given, done, held))
        if max(runs[-1].ratios(alone)) >= CAP_STOP:
            break
    for name in [*LOOKS_AT, "shared"]:
        result, rps, given, done, held = with_backfill(engine, work, name, SLOTS, people)
        runs.append(Run(name, level, result, rps, given, done, held))
    return runs


@dataclass
class Step:
    alone: LoadResult
    shared: LoadResult
    recovery_s: float
    """From the jump until people's latency is back within the budget of the same burst
    alone (and stays there)."""
    batch_request_s: float
    """One batch request's duration on a full engine: the target."""
    window_s: float
    given_back: float


def run_step(engine: Engine, work: Path, cap_rps: float) -> Step:
    calm, burst = (x * cap_rps for x in STEP_RATES)
    before_s = LEAD_S + SETTLE_S + STEP_S
    people = People([(before_s, calm), (STEP_S, burst), (STEP_S, calm)], seed=7)
    warm_up(engine, calm, 100, 8)
    alone = people.run(engine).between(before_s - STEP_S)
    shared, _, given, _, _ = with_backfill(engine, work, "shared", SLOTS, people)
    assert shared is not None
    # A window holds about ten people of the burst, and at least half a second of it.
    window = max(0.5, 10 / burst)
    recovery = 0.0
    t = before_s
    while t < before_s + STEP_S + 2 * window:
        mine, base = shared.between(t, t + window), alone.between(t, t + window)
        if _mean_ratio(mine, base, ttft=True) > BUDGET or _mean_ratio(mine, base) > BUDGET:
            recovery = t + window - before_s
        t += window
    return Step(alone, shared, recovery, SLOTS / cap_rps, window, given)


def _mean_ratio(mine: LoadResult, base: LoadResult, *, ttft: bool = False) -> float:
    def mean(result: LoadResult) -> float:
        values = [(x.ttft_s or 0.0) if ttft else x.latency_s for x in result.samples]
        return sum(values) / len(values) if values else 0.0

    base_mean = mean(base)
    return mean(mine) / base_mean if base_mean > 0 else 1.0


def report_step(step: Step) -> None:
    calm, burst = STEP_RATES
    base_s = LEAD_S + SETTLE_S + STEP_S
    mine, base = (
        step.shared.between(base_s, base_s + STEP_S),
        step.alone.between(base_s, base_s + STEP_S),
    )
    print(
        f"\nstep {calm:.0%} -> {burst:.0%} for {STEP_S:.0f} s on an engine full of batch work: "
        f"back within the budget after {step.recovery_s:.2f} s (windows of {step.window_s:.2f} s)"
        f"; one batch request on a full engine {step.batch_request_s:.2f} s"
        f"{'  within' if step.recovery_s <= step.batch_request_s else ''}"
    )
    print(
        f"  the burst beside shared: TTFT p99 {(mine.ttft.p99 or 0) / (base.ttft.p99 or 1):.2f}x, "
        f"e2e p50 {(mine.latency.p50 or 0) / (base.latency.p50 or 1):.2f}x, "
        f"e2e p99 {(mine.latency.p99 or 0) / (base.latency.p99 or 1):.2f}x; "
        f"{step.given_back:.0f} given back"
    )


def report(runs: list[Run]) -> None:
    if runs[0].level == 0:
        dedicated, shared = runs
        print(
            f"\nnobody else: dedicated {dedicated.batch_rps:.2f} req/s, shared "
            f"{shared.batch_rps:.2f} ({shared.batch_rps / max(dedicated.batch_rps, 1e-9):.2f}x)"
        )
        for run in runs:
            if run.held is not None:
                print(f"  {run.name}: {run.held.summary()}")
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
        if run.held is not None:
            print(f"{'':10} {run.held.summary()}")
    shared = runs[-1]
    if oracle is None:
        print(f"oracle: none within the budget; shared {shared.batch_rps:.2f} req/s")
    else:
        print(
            f"oracle: {oracle.name} ({oracle.batch_rps:.2f} req/s); shared "
            f"{shared.batch_rps:.2f} req/s = {shared.batch_rps / oracle.batch_rps:.2f}x"
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
    parser.add_argument("--levels", default="0,0.3,0.6,0.9,step")
    parser.add_argument("--people", type=int, default=600, help="people per run")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--shared", action="append", default=[], help="a shared engine setting")
    parser.add_argument("--caps", default="", help="static caps to run, e.g. 2,4 (default: all)")
    parser.add_argument(
        "--looks", default="", help="more shared runs, metrics read every N s (e.g. 0.1)"
    )
    args = parser.parse_args()
    SHARED_EXTRA.extend(args.shared)
    CAPS.extend(int(x) for x in args.caps.split(",") if x)
    LOOKS_AT.update((f"shared {x}s", float(x)) for x in args.looks.split(",") if x)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = start_engine(args.engine, work)
        try:
            cap_rps = capacity(engine)
            print(f"{args.engine}: capacity {cap_rps:.2f} people/s at {SLOTS} slots")
            tokens = args.levels.split(",")
            levels = [
                run_level(engine, work, float(x), cap_rps, args.people)
                for x in tokens
                if x != "step"
            ]
            step = run_step(engine, work, cap_rps) if "step" in tokens else None
            for runs in levels:
                report(runs)
            if step:
                report_step(step)
            plot(levels, args.plot or Path("docs") / f"frontier-{args.engine}.png", args.engine)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
