r"""Open-loop interactive load: Poisson arrivals, each request streamed, TTFT and latency.

    PYTHONPATH=. python -m bench.interactive_load --url http://127.0.0.1:9000/v1 --rate 5 \
        --duration 30

Interactive users do not wait for each other: requests arrive at exponential intervals (a
seeded RNG, so two runs send the same schedule) whether or not the engine keeps up. Each one
is a streamed chat completion; its time to first token runs from its *scheduled* arrival to
the first chunk with content, its latency to the end of the stream. A request the client sent
late still counts from its scheduled time, so a slow client cannot hide a slow engine.

Other benchmarks run it beside a Backfill drain with ``run_interactive_load(..., stop=event)``
and compare its percentiles with and without the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.common import MODEL


@dataclass(frozen=True)
class Percentiles:
    """Seconds; None when no request got that far."""

    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        ordered = sorted(values)
        return cls(*(_nearest_rank(ordered, p) for p in (50, 90, 99)))


@dataclass(frozen=True)
class Sample:
    """One request that got its answer, against its scheduled arrival."""

    offset_s: float
    """Seconds after the load's start at which it was scheduled to arrive."""
    ttft_s: float | None
    latency_s: float


@dataclass(frozen=True)
class LoadResult:
    sent: int
    ok: int
    errors: int
    ttft: Percentiles
    latency: Percentiles
    elapsed_s: float
    """From the first scheduled arrival to the end of the last request."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error_samples: tuple[str, ...] = field(default=())
    """The first few errors, for the report."""
    samples: tuple[Sample, ...] = field(default=())

    def between(self, start_s: float, end_s: float = math.inf) -> LoadResult:
        """The same figures over the requests scheduled in ``[start_s, end_s)`` only: a
        steady state after a warm-up, or one window of a step."""
        kept = [s for s in self.samples if start_s <= s.offset_s < end_s]
        return LoadResult(
            sent=len(kept),
            ok=len(kept),
            errors=0,
            ttft=Percentiles.of([s.ttft_s for s in kept if s.ttft_s is not None]),
            latency=Percentiles.of([s.latency_s for s in kept]),
            elapsed_s=self.elapsed_s,
            samples=tuple(kept),
        )

    def summary(self) -> str:
        def ms(value: float | None) -> str:
            return "   -   " if value is None else f"{value * 1000:7.1f}"

        return "\n".join(
            [
                f"requests {self.sent}  ok {self.ok}  errors {self.errors}  "
                f"in {self.elapsed_s:.1f} s",
                "              p50      p90      p99   (ms)",
                f"TTFT     {ms(self.ttft.p50)}  {ms(self.ttft.p90)}  {ms(self.ttft.p99)}",
                f"latency  {ms(self.latency.p50)}  {ms(self.latency.p90)}  {ms(self.latency.p99)}",
                f"prompt tokens {self.prompt_tokens}, cached {self.cached_tokens}",
                *(f"error: {e}" for e in self.error_samples),
            ]
        )


def arrival_offsets(rate: float, duration_s: float, seed: int) -> list[float]:
    """Seconds after the start at which requests arrive: a Poisson process of ``rate``/s."""
    return phased_offsets([(duration_s, rate)], seed)


def phased_offsets(phases: list[tuple[float, float]], seed: int) -> list[float]:
    """Arrivals of a Poisson process whose rate changes: ``(seconds, rate)`` one phase after
    another (a burst between two calm stretches)."""
    rng = random.Random(seed)
    offsets: list[float] = []
    begin = 0.0
    for duration_s, rate in phases:
        t = begin + rng.expovariate(rate)
        while t < begin + duration_s:
            offsets.append(t)
            t += rng.expovariate(rate)
        begin += duration_s
    return offsets


def interactive_body(
    i: int, *, model: str, max_tokens: int, prompt_words: int, shared_prefix: str
) -> bytes:
    """A chat request whose user text is unique to ``i``; ``shared_prefix`` (a system prompt)
    is the same for all, as the instructions of one chat application are."""
    question = " ".join(f"q{i}w{j}" for j in range(prompt_words))
    messages = [{"role": "user", "content": question}]
    if shared_prefix:
        messages.insert(0, {"role": "system", "content": shared_prefix})
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


@dataclass
class _Tally:
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_end: float = 0.0


async def run_interactive_load(
    url: str,
    *,
    rate: float = 0.0,
    duration_s: float = 0.0,
    model: str = MODEL,
    max_tokens: int = 64,
    prompt_words: int = 32,
    shared_prefix: str = "",
    seed: int = 0,
    timeout_s: float = 300.0,
    stop: asyncio.Event | None = None,
    phases: list[tuple[float, float]] | None = None,
) -> LoadResult:
    """Send Poisson arrivals at ``rate`` per second for ``duration_s`` to ``url`` (ending in
    ``/v1``), or until ``stop`` is set; then wait for the requests already sent. ``phases``
    (``(seconds, rate)`` each) replaces ``rate`` and ``duration_s`` with a changing rate."""
    phases = phases or [(duration_s, rate)]
    if any(rate <= 0 or seconds <= 0 for seconds, rate in phases):
        raise ValueError("rate and duration_s must be positive")
    offsets = phased_offsets(phases, seed)
    tally = _Tally()
    # No connection limit: an open-loop client must never queue its own requests.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    tasks: set[asyncio.Task[None]] = set()
    sent = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        for i, offset in enumerate(offsets):
            scheduled = start + offset
            if await _stopped_before(stop, scheduled - time.perf_counter()):
                break
            body = interactive_body(
                i,
                model=model,
                max_tokens=max_tokens,
                prompt_words=prompt_words,
                shared_prefix=shared_prefix,
            )
            task = asyncio.create_task(_one(session, url, body, start, offset, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        if tasks:
            await asyncio.gather(*tasks)
    return LoadResult(
        sent=sent,
        ok=len(tally.latency),
        errors=len(tally.errors),
        ttft=Percentiles.of(tally.ttft),
        latency=Percentiles.of(tally.latency),
        elapsed_s=max(0.0, tally.last_end - start),
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        error_samples=tuple(tally.errors[:5]),
        samples=tuple(sorted(tally.samples, key=lambda s: s.offset_s)),
    )


async def _stopped_before(stop: asyncio.Event | None, delay_s: float) -> bool:
    """Wait ``delay_s`` (nothing if late); True when ``stop`` was set first."""
    if stop is None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return False
    if stop.is_set():
        return True
    if delay_s > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay_s)
        except TimeoutError:
            return False
        return True
    return False


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    start: float,
    offset: float,
    tally: _Tally,
) -> None:
    scheduled = start + offset
    first: float | None = None
    try:
        async with session.post(
            url + "/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            if response.status != 200:
                text = (await response.read())[:200].decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status}: {text}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if first is None and _has_content(chunk):
                    first = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    tally.prompt_tokens += usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    tally.cached_tokens += details.get("cached_tokens", 0)
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
        tally.errors.append(f"{type(exc).__name__}: {exc}")
        tally.last_end = max(tally.last_end, time.perf_counter())
        return
    end = time.perf_counter()
    tally.last_end = max(tally.last_end, end)
    ttft = None if first is None else first - scheduled
    if ttft is not None:
        tally.ttft.append(ttft)
    tally.latency.append(end - scheduled)
    tally.samples.append(Sample(offset, ttft, end - scheduled))


def _has_content(chunk: dict[str, object]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
    return isinstance(delta, dict) and bool(delta.get("content"))


def _nearest_rank(ordered: list[float], percent: float) -> float | None:
    if not ordered:
        return None
    return ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="engine base URL ending in /v1")
    parser.add_argument("--rate", type=float, required=True, help="arrivals per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--shared-prefix-words", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    args = parser.parse_args()
    shared = " ".join(f"system{j}" for j in range(args.shared_prefix_words))
    result = asyncio.run(
        run_interactive_load(
            args.url,
            rate=args.rate,
            duration_s=args.duration,
            model=args.model,
            max_tokens=args.max_tokens,
            prompt_words=args.prompt_words,
            shared_prefix=shared,
            seed=args.seed,
            timeout_s=args.timeout,
        )
    )
    print(
        f"open-loop load: {args.rate}/s for {args.duration} s, max_tokens {args.max_tokens}, "
        f"seed {args.seed}"
    )
    print(result.summary())


if __name__ == "__main__":
    main()
