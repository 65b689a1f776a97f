"""Prefix locality: cached prompt tokens on three replicas, Backfill's routing vs round robin.

    PYTHONPATH=. python -m bench.locality                 # about two minutes
    PYTHONPATH=. python -m bench.locality --groups 400 --lines 20000

Three simulated replicas of one model, each with its own LRU prefix cache (``backfill
simulate --prefix-cache-blocks``), drain one batch whose lines share long system prompts in
``--groups`` groups, the groups' lines shuffled through the file. Three runs in one go:

- **round robin**: ``prefix_locality = false``: each replica claims on its own;
- **locality**: Backfill's default: the replicas claim together and each prompt prefix goes
  to one replica (rendezvous hashing bounded by room), lines of one prefix back to back;
- **ideal**: one engine with the three replicas' slots and a cache that never evicts: every
  group misses once, every other line hits its whole shared prefix.

The engines prefill 0.2 ms per uncached prompt word, so a cache hit also shortens a request.
The cached share is the batch's ``usage.input_tokens_details.cached_tokens`` over its input
tokens (the simulator reports them as vLLM does). Target: locality ≥ 90% of the ideal,
throughput not lower than round robin. A plot goes to ``docs/locality.png``.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from matplotlib.figure import Figure

from bench.common import (
    MODEL,
    create_batch,
    start_backfill,
    start_simulator,
    stop,
    upload,
    wait_batch,
)

REPLICAS = 3
SLOTS = 64
PREFIX_WORDS = 240
QUESTION_WORDS = 24
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Run:
    name: str
    seconds: float
    input_tokens: int
    cached_tokens: int

    @property
    def share(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


def write_input(path: Path, groups: int, lines: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    words = [f"w{n}" for n in range(5000)]
    prefixes = [" ".join(rng.choices(words, k=PREFIX_WORDS)) for _ in range(groups)]
    with path.open("wb") as out:
        for i in range(lines):
            group = rng.randrange(groups)
            question = " ".join(rng.choices(words, k=QUESTION_WORDS))
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": prefixes[group]},
                    {"role": "user", "content": f"Question {i}: {question}"},
                ],
                "max_tokens": 8,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            out.write(orjson.dumps(line | {"body": body}) + b"\n")


def simulator(slots: int, cache_blocks: int) -> tuple[subprocess.Popen[bytes], str]:
    return start_simulator(
        *("--slots", str(slots)),
        *("--ttft-ms", "5", "--prefill-ms-per-token", "0.2"),
        *("--itl-ms", "20", "--output-tokens", "8"),
        *("--block-tokens", str(BLOCK_TOKENS), "--prefix-cache-blocks", str(cache_blocks)),
        *("--model-name", MODEL),
    )


def config(path: Path, urls: list[str], locality: bool) -> Path:
    engines = "".join(
        f"""
[[engines]]
name = "replica-{n}"
base_url = "{url}"
models = ["{MODEL}"]
max_concurrency = {SLOTS * (REPLICAS if len(urls) == 1 else 1)}
"""
        for n, url in enumerate(urls)
    )
    path.write_text(
        f"""
local_engine = false
prefix_locality = {str(locality).lower()}

[[models]]
id = "{MODEL}"
model_config_id = "sim-model-v1"
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}
{engines}"""
    )
    return path


def drain(name: str, settings: Path, work: Path, source: Path) -> Run:
    process, base, key = start_backfill(settings, work / f"data-{name}", work / f"{name}.log")
    try:
        client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600
        )
        file_id = upload(client, source)
        start = time.perf_counter()
        batch = wait_batch(client, create_batch(client, file_id))
        seconds = time.perf_counter() - start
        if batch["status"] != "completed":
            raise RuntimeError(f"{name}: the batch ended {batch['status']}")
        usage = batch["usage"]
        return Run(
            name, seconds, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
        )
    finally:
        stop(process)


def run(name: str, work: Path, source: Path, groups: int) -> Run:
    # Half the groups' prefix blocks per replica (room for the third routed to it, not for
    # all of them), or four times all of them for the ideal engine.
    blocks = PREFIX_WORDS // BLOCK_TOKENS + 2
    if name == "ideal":
        engines = [simulator(SLOTS * REPLICAS, blocks * groups * 4)]
    else:
        engines = [simulator(SLOTS, blocks * groups // 2) for _ in range(REPLICAS)]
    try:
        urls = [url for _, url in engines]
        settings = config(work / f"{name}.toml", urls, locality=name != "round robin")
        return drain(name, settings, work, source)
    finally:
        for process, _ in engines:
            stop(process)


def plot(runs: list[Run], path: Path) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    names = [r.name for r in runs]
    ax.bar(names, [100 * r.share for r in runs], color=["#999999", "#3b7dd8", "#2ca02c"])
    ideal = next((r.share for r in runs if r.name == "ideal"), 0.0)
    if ideal:
        ax.axhline(90 * ideal, linestyle="--", color="grey", label="90% of the ideal (target)")
        ax.legend(loc="lower right")
    ax.set_ylabel("cached prompt tokens (% of input tokens)")
    ax.set_title(f"Prefix cache hits on {REPLICAS} replicas")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--plot", type=Path, default=Path("docs/locality.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "input.jsonl"
        write_input(source, args.groups, args.lines)
        runs = [
            run(name, work, source, args.groups) for name in ("round robin", "locality", "ideal")
        ]
    print(
        f"{REPLICAS} replicas x {SLOTS} slots; {args.lines:,} lines in {args.groups} prefix "
        f"groups of {PREFIX_WORDS} words, shuffled"
    )
    ideal = runs[-1].share
    baseline = runs[0]
    print(f"{'routing':<12} {'seconds':>8} {'req/s':>8} {'cached share':>12} {'of ideal':>9}")
    for r in runs:
        print(
            f"{r.name:<12} {r.seconds:8.1f} {args.lines / r.seconds:8.0f} {100 * r.share:11.1f}% "
            f"{r.share / ideal:9.2f}"
        )
    print(
        f"locality: {runs[1].share / ideal:.2f} of the ideal cached share (target >= 0.90), "
        f"throughput {baseline.seconds / runs[1].seconds:.2f}x round robin (target >= 1.00x)"
    )
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
