"""``bench.interactive_load`` against the simulated engine: its schedule, counts and stop."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from backfill.simulator.server import SimulatorConfig
from bench.interactive_load import (
    Percentiles,
    arrival_offsets,
    phased_offsets,
    run_interactive_load,
)
from tests.support import running_simulator

FAST = SimulatorConfig(ttft_ms=2, itl_ms=1, output_tokens=8, slots=16)


def test_arrivals_are_a_seeded_poisson_process() -> None:
    offsets = arrival_offsets(rate=200, duration_s=50, seed=3)
    assert offsets == arrival_offsets(rate=200, duration_s=50, seed=3)
    assert offsets != arrival_offsets(rate=200, duration_s=50, seed=4)
    assert offsets == sorted(offsets)
    assert offsets[0] > 0
    assert offsets[-1] < 50
    # 10,000 expected; a Poisson count's standard deviation is 100.
    assert 9_500 < len(offsets) < 10_500
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 200, rel=0.05)
    # Exponential gaps: about 1 - 1/e of them are shorter than the mean.
    assert sum(g < mean for g in gaps) / len(gaps) == pytest.approx(0.632, abs=0.03)


def test_phases_change_the_rate_at_their_boundaries() -> None:
    # A step: 20/s for 10 s, 200/s for 10 s, 20/s again.
    offsets = phased_offsets([(10, 20), (10, 200), (10, 20)], seed=5)
    assert offsets == sorted(offsets)
    calm = [t for t in offsets if t < 10]
    burst = [t for t in offsets if 10 <= t < 20]
    after = [t for t in offsets if t >= 20]
    assert 140 < len(calm) < 260
    assert 1_850 < len(burst) < 2_150
    assert 140 < len(after) < 260
    assert offsets[-1] < 30
    assert phased_offsets([(50, 200)], seed=3) == arrival_offsets(200, 50, seed=3)


def test_percentiles_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert Percentiles.of(values) == Percentiles(50.0, 90.0, 99.0)
    assert Percentiles.of([]) == Percentiles(None, None, None)
    assert Percentiles.of([7.0]) == Percentiles(7.0, 7.0, 7.0)


async def test_every_scheduled_request_is_sent_and_measured() -> None:
    async with running_simulator(FAST) as (url, simulator):
        result = await run_interactive_load(
            url, rate=60, duration_s=0.5, seed=1, max_tokens=8, prompt_words=10
        )
    expected = len(arrival_offsets(60, 0.5, 1))
    assert expected > 5
    assert (result.sent, result.ok, result.errors) == (expected, expected, 0)
    assert simulator.stats.by_status[200] == expected
    assert result.prompt_tokens == expected * 10
    for ttft, latency in zip(
        (result.ttft.p50, result.ttft.p90, result.ttft.p99),
        (result.latency.p50, result.latency.p90, result.latency.p99),
        strict=True,
    ):
        assert ttft is not None
        assert latency is not None
        assert 0 < ttft <= latency
    assert "requests" in result.summary()
    # Each answer is kept against its scheduled arrival, so a window can be measured alone.
    assert [x.offset_s for x in result.samples] == arrival_offsets(60, 0.5, 1)
    later = result.between(0.25)
    assert later.ok == sum(1 for t in arrival_offsets(60, 0.5, 1) if t >= 0.25)
    assert all(x.offset_s >= 0.25 for x in later.samples)
    assert later.latency.p99 is not None


async def test_a_shared_prefix_reaches_the_prefix_cache() -> None:
    config = SimulatorConfig(
        ttft_ms=2, itl_ms=1, output_tokens=4, slots=16, prefix_cache_blocks=100
    )
    shared = " ".join(f"rule{i}" for i in range(64))
    async with running_simulator(config) as (url, _):
        result = await run_interactive_load(
            url, rate=40, duration_s=0.5, seed=2, max_tokens=4, shared_prefix=shared
        )
    assert result.ok >= 4
    # Each request after the first can reuse the 64-word system prompt (four blocks of 16),
    # unless it arrived while the first one was still in prefill; the user text never hits.
    assert (result.ok - 1) * 64 / 2 <= result.cached_tokens <= (result.ok - 1) * 64


async def test_errors_are_counted_not_raised() -> None:
    async with running_simulator(FAST) as (url, _):
        result = await run_interactive_load(
            url, rate=40, duration_s=0.3, seed=5, shared_prefix="[[sim:status=503]]"
        )
    assert result.sent > 0
    assert (result.ok, result.errors) == (0, result.sent)
    assert result.ttft == Percentiles(None, None, None)
    assert "HTTP 503" in result.error_samples[0]


async def test_stop_ends_the_arrivals_and_waits_for_those_sent() -> None:
    async with running_simulator(FAST) as (url, _):
        stop = asyncio.Event()
        load = asyncio.create_task(
            run_interactive_load(url, rate=50, duration_s=600, seed=7, stop=stop)
        )
        await asyncio.sleep(0.3)
        stop.set()
        result = await asyncio.wait_for(load, timeout=30)
    assert 0 < result.sent < len(arrival_offsets(50, 600, 7))
    assert result.ok == result.sent


async def test_latency_counts_from_the_scheduled_arrival() -> None:
    # The client falls behind (its loop is blocked for 300 ms): the requests it sends late
    # carry that lateness in their latency, as an open-loop measurement must.
    async with running_simulator(FAST) as (url, _):
        on_time = await run_interactive_load(url, rate=100, duration_s=0.4, seed=11)
        asyncio.get_running_loop().call_later(0.05, time.sleep, 0.3)
        late = await run_interactive_load(url, rate=100, duration_s=0.4, seed=11)
    assert late.sent == on_time.sent == late.ok
    assert on_time.latency.p90 is not None
    assert late.latency.p90 is not None
    assert late.latency.p90 > 5 * on_time.latency.p90
