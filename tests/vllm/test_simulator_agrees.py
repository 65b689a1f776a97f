"""The simulator is a claim about vLLM: the same small scenarios run on both must agree on
what the shared-engine figures depend on (docs/simulator.md).

- Who gets a freed slot: the best (priority, arrival) under ``--scheduling-policy priority``,
  arrival order under ``fcfs`` (which ignores priority).
- KV pressure: how many preemptions, and the order requests finish in.
- Latency against concurrency: the simulator's step, the sequences it holds flat for, its
  growth per sequence past them and the prefill cost, fitted to the engine's latencies at
  one, two, four and eight sequences in the same run (the machine's speed varies, and so
  does the curve), give the engine's latency at each level within 15%.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import numpy
import orjson
import pytest

from backfill.simulator.model import STEP_PROFILES
from backfill.simulator.server import SimulatorConfig
from bench import vllm
from bench.vllm import VllmProcess
from tests.support import running_simulator

pytestmark = pytest.mark.vllm

Policy = Literal["fcfs", "priority"]
# Four slots and four KV blocks of 128 tokens: small enough that long answers run out of
# blocks and preempt, large enough that short prompts and the waiting order stay apart.
SLOTS, BLOCK, BLOCKS = 4, 128, 4
TIGHT = (
    "--block-size",
    str(BLOCK),
    "--num-gpu-blocks-override",
    str(BLOCKS + 1),  # vLLM keeps one block aside (its null block)
    "--max-model-len",
    str(BLOCK * BLOCKS),
    "--no-enable-prefix-caching",
)


class Target:
    """One engine as the scenarios drive it: its URL, and how a prompt of ``n`` tokens is
    written for it (vLLM's chat template adds tokens; the simulator counts words)."""

    def __init__(self, url: str, *, real: bool, template_tokens: int = 0) -> None:
        self.url = url
        self.real = real
        self.template_tokens = template_tokens
        self.sent = 0

    def body(self, tokens: int, max_tokens: int, priority: int = 0, **more: Any) -> bytes:
        words = max(1, tokens - self.template_tokens)
        # A different first word each time: no prompt is found in the prefix cache.
        self.sent += 1
        content = " ".join([f"n{self.sent}", *["hello"] * (words - 1)])
        body: dict[str, Any] = {
            "model": vllm.SERVED_MODEL if self.real else "simulated",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "priority": priority,
            **more,
        }
        if self.real:
            body["ignore_eos"] = True  # exact lengths, as the simulator's
        return orjson.dumps(body)

    async def preemptions(self, session: aiohttp.ClientSession) -> float:
        async with session.get(self.url.removesuffix("/v1") + "/metrics") as r:
            page = await r.text()
        found = re.findall(r"^vllm:num_preemptions_total(?:{[^}]*})? (\S+)$", page, re.M)
        return sum(float(v) for v in found)


async def post(session: aiohttp.ClientSession, target: Target, body: bytes) -> float:
    """Send one request, wait for its whole answer; when it ended (perf_counter)."""
    headers = {"Content-Type": "application/json"}
    async with session.post(target.url + "/chat/completions", data=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.perf_counter()


async def first_token(session: aiohttp.ClientSession, target: Target, body: bytes) -> None:
    """A streamed request: returns once its first token came (it holds a slot), and reads
    the rest in the background."""
    started = asyncio.get_running_loop().create_future()

    async def run() -> None:
        headers = {"Content-Type": "application/json"}
        async with session.post(target.url + "/chat/completions", data=body, headers=headers) as r:
            async for line in r.content:
                if line.startswith(b"data: {") and not started.done():
                    started.set_result(None)
        if not started.done():
            started.set_result(None)

    task = asyncio.create_task(run())
    await started
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


async def who_gets_freed_slots(target: Target) -> list[str]:
    """Four streams hold every slot and end one after another; then A, B and C arrive in
    that order with priorities 5, 1 and 3. The order they finish in."""
    async with aiohttp.ClientSession() as session:
        for i in range(SLOTS):
            # 35-token prompts and up to 90 tokens: each fits in its one block.
            await first_token(session, target, target.body(35, 30 + 20 * i, stream=True))
        finished: dict[str, float] = {}

        async def one(name: str, priority: int) -> None:
            finished[name] = await post(session, target, target.body(35, 2, priority))

        tasks = []
        for name, priority in (("A", 5), ("B", 1), ("C", 3)):
            tasks.append(asyncio.create_task(one(name, priority)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks, *_background)
    return sorted(finished, key=finished.__getitem__)


async def preempted_under_kv_pressure(target: Target) -> tuple[float, list[str]]:
    """Four requests fit at first (one block each) and each grows to two: blocks run out.
    Priorities 4, 3, 2, 1: the worst (priority, arrival) is the first to arrive. The
    preemptions counted, and the order they finish in."""
    async with aiohttp.ClientSession() as session:
        before = await target.preemptions(session)
        finished: dict[str, float] = {}

        async def one(name: str, priority: int) -> None:
            finished[name] = await post(session, target, target.body(35, 120, priority))

        tasks = []
        for i, name in enumerate("PQRS"):
            tasks.append(asyncio.create_task(one(name, 4 - i)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        after = await target.preemptions(session)
    return after - before, sorted(finished, key=finished.__getitem__)


def sim_config(policy: Policy, step: dict[str, float], slots: int, **more: Any) -> SimulatorConfig:
    return SimulatorConfig(
        slots=slots,
        scheduling_policy=policy,
        output_tokens=4096,
        ttft_ms=step["ttft_ms"],
        itl_ms=step["itl_ms"],
        itl_growth=step["itl_growth"],
        itl_knee=int(step.get("itl_knee", 0)),
        prefill_ms_per_token=step["prefill_ms_per_token"],
        **more,
    )


def steep(slots: int) -> dict[str, float]:
    """The steep profile for an engine of ``slots``: its growth is per slot of 16."""
    profile = STEP_PROFILES["steep"]
    return {
        "ttft_ms": profile.ttft_ms,
        "itl_ms": profile.itl_ms,
        "itl_growth": profile.itl_growth * slots / 16,
        "prefill_ms_per_token": profile.prefill_ms_per_token,
    }


@pytest.fixture(scope="module", params=["priority", "fcfs"])
def tight_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Policy, VllmProcess]]:
    policy: Policy = request.param
    log = tmp_path_factory.mktemp(f"vllm-{policy}") / "vllm.log"
    engine = vllm.start_vllm(log, max_num_seqs=SLOTS, policy=policy, extra=TIGHT)
    try:
        yield policy, engine
    finally:
        engine.stop()


TEMPLATE_TOKENS = 30  # SmolLM2's chat template around one user message


async def test_the_same_request_gets_a_freed_slot(tight_engine: tuple[Policy, VllmProcess]) -> None:
    policy, engine = tight_engine
    real = await who_gets_freed_slots(Target(engine.base_url, real=True, template_tokens=30))
    config = sim_config(
        policy, steep(SLOTS), SLOTS, kv_capacity_tokens=BLOCK * BLOCKS, block_tokens=BLOCK
    )
    async with running_simulator(config) as (url, _):
        simulated = await who_gets_freed_slots(Target(url, real=False))
    expected = ["B", "C", "A"] if policy == "priority" else ["A", "B", "C"]
    assert real == expected, f"vLLM ({policy}) served {real}"
    assert simulated == real


async def test_kv_pressure_preempts_the_same_requests(
    tight_engine: tuple[Policy, VllmProcess], request: pytest.FixtureRequest
) -> None:
    policy, engine = tight_engine
    if policy == "priority":
        # The order in which the priority policy preempts and resumes follows when each
        # request arrived relative to the steps: on an uncalibrated CPU those are another
        # engine's (seen there: R finished before S). fcfs held on that CPU too.
        request.getfixturevalue("calibrated_cpu")
    real = await preempted_under_kv_pressure(
        Target(engine.base_url, real=True, template_tokens=TEMPLATE_TOKENS)
    )
    config = sim_config(
        policy, steep(SLOTS), SLOTS, kv_capacity_tokens=BLOCK * BLOCKS, block_tokens=BLOCK
    )
    async with running_simulator(config) as (url, _):
        simulated = await preempted_under_kv_pressure(Target(url, real=False))
    assert real[0] > 0, f"vLLM ({policy}) preempted nothing: the scenario lost its point"
    assert simulated[0] == real[0]
    # The preempted requests finish last, in the same order. The two never preempted may end
    # in the same step, or in steps 50 ms apart, as their arrivals fall against the steps (on
    # one AVX-512 CPU vLLM gave R before S in one run of two): their order is a tie, not a
    # claim of the model.
    assert simulated[1][2:] == real[1][2:]
    assert set(simulated[1][:2]) == set(real[1][:2])


LEVELS = (1, 2, 4, 8)
ROUNDS = 5


async def latencies(target: Target, rounds: int = ROUNDS) -> dict[tuple[int, int], float]:
    """The mean end-to-end seconds of ``c`` requests of ``n`` tokens sent together, for each
    level ``c`` and each length ``n`` of 1 and 33: the least over ``rounds``, taken in turn.

    A busy machine only ever adds time, and its speed drifts over seconds: measured one level
    after another, the least of three at two sequences once came out 10% above the one at
    four, on a step that barely grows, and a CI run's median of two put two sequences above
    eight (1.78 s against 1.61). Rounds that go through every level in turn see the same
    drift at each, and the least of five is the engine's own speed."""
    least: dict[tuple[int, int], float] = {}
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            for key in ((c, n) for c in LEVELS for n in (1, 33)):
                count, tokens = key
                start = time.perf_counter()
                ends = await asyncio.gather(
                    *(post(session, target, target.body(35, tokens)) for _ in range(count))
                )
                mean = statistics.mean(end - start for end in ends)
                least[key] = min(mean, least.get(key, mean))
    return least


def calibrated(real: dict[tuple[int, int], float], slots: int) -> dict[str, float]:
    """The simulator's figures fitted to the engine's latencies at every level: a fixed
    cost, the prefill per prompt token, and a step that holds its base time up to a knee of
    ``k`` sequences and grows by the same amount with each one past it. A request of ``n``
    tokens sent with ``c`` others of 35-token prompts takes ``ttft + 35 c prefill + n (step +
    max(0, c - k) growth)``: least squares over the eight measurements for each knee from
    none to ``slots``, the knee whose fit is closest kept (the smaller one on a tie: the
    levels measured cannot tell four from seven).

    The figures vary with the CPU (on two cores of one AVX-512 Xeon a sequence added about
    1.5 ms to a 45 ms step, on an AMD EPYC of the same machine kind about 10 ms to 52 ms;
    on another the step stayed near 32 ms up to four sequences and reached 44 at eight), so
    they are measured in the same run. What the simulator claims is the shape: fitted
    once, it must hold at every level within 15%. A line through every level missed four
    sequences by 17% on that last CPU (a CI run), on a step that bends."""
    keys = sorted(real)
    measured = numpy.array([real[k] for k in keys])
    best: tuple[float, int, list[float]] | None = None
    for knee in range(slots + 1):
        rows = [[1.0, 35.0 * c, float(n), float(n * max(0, c - knee))] for c, n in keys]
        fit = numpy.linalg.lstsq(numpy.array(rows), measured)[0]
        residual = float(numpy.sum((numpy.array(rows) @ fit - measured) ** 2))
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, knee, [float(x) for x in fit])
    assert best is not None
    _, knee, (ttft_s, prefill_s, step_s, per_seq_s) = best
    return {
        "itl_ms": 1000 * step_s,
        "itl_growth": max(0.0, per_seq_s) * slots / step_s,
        "itl_knee": knee,
        "prefill_ms_per_token": 1000 * max(0.0, prefill_s),
        "ttft_ms": 1000 * max(0.0, ttft_s),
    }


@pytest.mark.usefixtures("calibrated_cpu")
async def test_latency_against_concurrency_within_15_percent(vllm_engine: VllmProcess) -> None:
    slots = 8  # the tier's engine
    real_target = Target(vllm_engine.base_url, real=True, template_tokens=TEMPLATE_TOKENS)
    real = await latencies(real_target)
    measured = calibrated(real, slots)
    async with running_simulator(sim_config("priority", measured, slots)) as (url, _):
        simulated = await latencies(Target(url, real=False), rounds=2)
    # The 33-token answers, at each level.
    ratios = {c: simulated[c, 33] / real[c, 33] for c in LEVELS}
    print(f"calibrated {measured}; real {real}; simulated/real {ratios}")
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), (measured, ratios, real, simulated)
