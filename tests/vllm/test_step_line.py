"""The step curve Backfill learns from a real vLLM (docs/scheduling.md, "people's latency
budget"): read through the same metrics probe and governor a shared engine uses, while the
engine runs 1, then 4, then 8 sequences at a time, it predicts the step the engine took at
each level. (How much a sequence adds is the engine's own and need not be a line: on this
machine kind's two cores with SmolLM2-135M, one run measured 42 ms a step at one sequence
and 47 ms at four and at eight; another, on another CPU, 35, 38 and 70 ms, where a line
through them was off by a third at one sequence; a third 51, 121 and 166 ms, where a fit
that forgot one sequence while the engine ran four and eight put it 75% too high. The
levels run one after another, as an engine the governor holds at one count for a while.)"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import aiohttp
import orjson
import pytest

from backfill.adapters.engines.pressure import Flavor, MetricsProbe
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, SharedTargets
from bench import vllm
from bench.vllm import VllmProcess

pytestmark = pytest.mark.vllm

LEVELS = (1, 4, 8)
PHASE_S = 6.0


async def keep_running(url: str, count: int, until: float) -> None:
    """``count`` sequences on the engine until ``until``: each answer of 48 tokens followed
    at once by the next (a closed loop, so the running count stays put)."""
    body = orjson.dumps(
        {
            "model": vllm.SERVED_MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 48,
            "ignore_eos": True,
        }
    )
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            while time.monotonic() < until:
                async with session.post(f"{url}/chat/completions", data=body, headers=headers):
                    pass

        await asyncio.gather(*(one() for _ in range(count)))


def itl(page: str) -> tuple[float, float]:
    """vLLM's inter-token latency histogram: (sum of seconds, count)."""

    def value(name: str) -> float:
        found = re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", page, re.M)
        return sum(float(v) for v in found)

    return value("inter_token_latency_seconds_sum"), value("inter_token_latency_seconds_count")


@pytest.mark.usefixtures("calibrated_cpu")
async def test_the_learnt_step_curve_predicts_the_step_at_each_level(
    vllm_engine: VllmProcess,
) -> None:
    probe = MetricsProbe(vllm_engine.base_url.removesuffix("/v1") + "/metrics", Flavor.VLLM)
    governor = ConcurrencyLimit(8, Mode.SHARED, SharedTargets(slots=8))

    async def follow() -> None:
        while True:
            pressure = await probe.read()
            if pressure is not None:
                governor.on_pressure(pressure, 0, time.monotonic())
            await asyncio.sleep(0.1)

    measured: dict[int, float] = {}
    follower = asyncio.create_task(follow())
    try:
        async with aiohttp.ClientSession() as session:
            for level in LEVELS:
                # The first second of a level ramps up (prefills): its steps are not the level's.
                runs = asyncio.create_task(
                    keep_running(vllm_engine.base_url, level, time.monotonic() + PHASE_S)
                )
                await asyncio.sleep(1.0)
                async with session.get(probe.url) as r:
                    before = itl(await r.text())
                await asyncio.sleep(PHASE_S - 2.0)
                async with session.get(probe.url) as r:
                    after = itl(await r.text())
                await runs
                tokens = after[1] - before[1]
                assert tokens > 0, f"no token came at {level} sequences in {PHASE_S - 2} s"
                measured[level] = (after[0] - before[0]) / tokens
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await probe.close()
    curve = governor.steps.curve
    assert curve is not None, measured
    predicted = {level: curve.step_s(level) for level in LEVELS}
    ratios = {level: predicted[level] / measured[level] for level in LEVELS}
    print(f"step curve {curve}; measured {measured}; predicted/measured {ratios}")
    assert all(0.75 < r < 1.33 for r in ratios.values()), (curve, measured, ratios)
