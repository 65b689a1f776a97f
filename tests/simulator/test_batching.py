"""The simulated engine's continuous batching as a client sees it over HTTP.

Timing assertions compare two measurements from the same run (a ratio or an order), never a
duration against a constant.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import running_simulator

LONG_PREFIX = " ".join(f"shared{i}" for i in range(200))


def chat(content: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


class Client:
    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.root = url.removesuffix("/v1")
        self.http = http

    async def post(self, body: dict[str, Any], path: str = "/chat/completions") -> httpx.Response:
        return await self.http.post(self.url + path, json=body)

    async def timed(self, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        start = time.perf_counter()
        response = await self.post(body)
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return time.perf_counter() - start, data

    async def metrics(self) -> dict[str, float]:
        """Sample name (with any label other than model_name and engine) -> value."""
        text = (await self.http.get(self.root + "/metrics")).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                extra = {
                    k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")
                }
                key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(extra.items()))
                out[key] = sample.value
        return out

    async def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = (await self.http.get(self.root + "/stats")).json()
        return data


@asynccontextmanager
async def client_for(config: SimulatorConfig) -> AsyncIterator[tuple[Client, Simulator]]:
    async with (
        running_simulator(config) as (url, simulator),
        httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as http,
    ):
        yield Client(url, http), simulator


async def wait_for(predicate: Any, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not await predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def test_running_never_exceeds_slots_and_the_rest_wait() -> None:
    config = SimulatorConfig(ttft_ms=5, itl_ms=5, output_tokens=20, slots=4)
    async with client_for(config) as (client, simulator):
        requests = [asyncio.create_task(client.timed(chat(f"q{i}", 100))) for i in range(16)]
        seen: list[dict[str, float]] = []
        while not all(r.done() for r in requests):
            seen.append(await client.metrics())
            await asyncio.sleep(0.01)
        await asyncio.gather(*requests)
        assert max(m["vllm:num_requests_running"] for m in seen) <= 4
        assert max(m["vllm:num_requests_waiting"] for m in seen) >= 1
        stats = await client.stats()
        assert stats["peak_running"] == 4
        assert stats["peak_in_flight"] > 4  # the others were queued inside the engine
        after = await client.metrics()
        assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
        assert after["vllm:request_success_total[finished_reason=stop]"] == 16
        assert after["vllm:generation_tokens_total"] == 16 * 20
        assert after["vllm:time_to_first_token_seconds_count"] == 16
        assert simulator.model is not None
        assert simulator.model.peak_running == 4


async def test_time_to_first_token_grows_while_the_slots_are_full() -> None:
    config = SimulatorConfig(ttft_ms=10, itl_ms=10, output_tokens=40, slots=2)
    async with client_for(config) as (client, _):
        alone = await first_token_s(client, "probe alone")
        fillers = [asyncio.create_task(client.timed(chat(f"filler {i}", 100))) for i in range(2)]

        async def full() -> bool:
            return (await client.metrics())["vllm:num_requests_running"] == 2

        await wait_for(full)
        queued = await first_token_s(client, "probe behind the fillers")
        await asyncio.gather(*fillers)
        assert queued > 3 * alone


async def first_token_s(client: Client, content: str) -> float:
    start = time.perf_counter()
    body = chat(content, 4, stream=True)
    async with client.http.stream("POST", client.url + "/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if '"content":"tok"' in line:
                return time.perf_counter() - start
    raise AssertionError("no token came")


async def test_decode_slows_down_with_more_running_sequences() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=4, output_tokens=50, slots=32, itl_growth=3.0)
    async with client_for(config) as (client, _):
        alone, _ = await client.timed(chat("alone", 100))
        crowd = await asyncio.gather(*(client.timed(chat(f"crowd {i}", 100)) for i in range(32)))
        times = sorted(t for t, _ in crowd)
        # A step alone: 4 * (1 + 3/32) ms; with 32 running: 4 * (1 + 3) ms, 3.7 times longer.
        assert times[len(times) // 2] > 2 * alone


async def test_a_shared_prefix_is_served_from_the_cache() -> None:
    config = SimulatorConfig(
        ttft_ms=1, itl_ms=0, slots=4, prefill_ms_per_token=1, prefix_cache_blocks=1000
    )
    async with client_for(config) as (client, _):
        first_s, first = await client.timed(chat(LONG_PREFIX + " first question"))
        before = await client.metrics()
        second_s, second = await client.timed(chat(LONG_PREFIX + " second question"))
        after = await client.metrics()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 202
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # 200 shared words = 12 full blocks of 16 tokens.
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 192}
    assert (
        after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 202
    )
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 192
    assert after["vllm:prefix_cache_hits_total"] == 192
    # 202 tokens to prefill against 10.
    assert second_s < first_s / 2


async def test_the_least_recently_used_prefix_is_evicted() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, slots=4, prefix_cache_blocks=12)
    a = " ".join(f"a{i}" for i in range(192))
    b = " ".join(f"b{i}" for i in range(192))
    async with client_for(config) as (client, _):
        cached = []
        for prefix in (a, a, b, a):
            _, data = await client.timed(chat(prefix + " tail"))
            cached.append(data["usage"]["prompt_tokens_details"]["cached_tokens"])
    # b's twelve blocks push all of a's out of a twelve-block cache.
    assert cached == [0, 192, 0, 0]


async def test_without_a_prefix_cache_usage_has_no_details() -> None:
    async with client_for(SimulatorConfig(ttft_ms=1, itl_ms=0, slots=4)) as (client, _):
        _, data = await client.timed(chat(LONG_PREFIX))
        _, again = await client.timed(chat(LONG_PREFIX))
        metrics = await client.metrics()
    assert "prompt_tokens_details" not in again["usage"]
    assert data["usage"]["prompt_tokens"] == 200
    assert metrics["vllm:prefix_cache_queries_total"] == 0


async def test_directives_still_work_with_slots() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=8, slots=2)
    async with client_for(config) as (client, simulator):
        assert (await client.post(chat("[[sim:status=400]]"))).status_code == 400
        assert (await client.post(chat("flaky [[sim:fail_first=1]]"))).status_code == 503
        assert (await client.post(chat("flaky [[sim:fail_first=1]]"))).status_code == 200
        _, few = await client.timed(chat("[[sim:tokens=3]]"))
        assert few["usage"]["completion_tokens"] == 3
        assert few["choices"][0]["message"]["content"] == "tok tok tok"
        plain_s, _ = await client.timed(chat("plain"))
        delayed_s, _ = await client.timed(chat("slow [[sim:delay_ms=300]]"))
        assert delayed_s > 3 * plain_s  # 300 ms of delay against about ten of work
        with pytest.raises(httpx.TransportError):
            await client.post(chat("[[sim:drop]]"))
        assert simulator.stats.by_status[0] == 1
        assert (await client.post(chat("after the drop"))).status_code == 200


async def test_a_delay_directive_holds_its_slot() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=4, slots=1)
    async with client_for(config) as (client, _):
        slow = asyncio.create_task(client.timed(chat("[[sim:delay_ms=400]]")))

        async def busy() -> bool:
            return (await client.metrics())["vllm:num_requests_running"] == 1

        await wait_for(busy)
        behind_s, _ = await client.timed(chat("behind"))
        slow_s, _ = await slow
        assert behind_s > slow_s / 2  # it waited for the delayed request's slot


async def test_a_client_that_leaves_frees_its_slot() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=20_000, slots=1)
    async with client_for(config) as (client, _):
        with pytest.raises(httpx.ReadTimeout):
            await client.http.post(
                client.url + "/chat/completions", json=chat("long", 20_000), timeout=0.2
            )

        async def idle() -> bool:
            return (await client.metrics())["vllm:num_requests_running"] == 0

        # Twenty thousand tokens of 1 ms would hold the slot for 20 s.
        await wait_for(idle, deadline_s=5.0)
        _, data = await client.timed(chat("next", 4))
        assert data["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous"),
        ({"stream": True, "stream_options": [1]}, "stream_options"),
        ({"max_tokens": "7"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
        ({"priority": "1"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
    ],
)
@pytest.mark.parametrize("slots", [0, 2])
async def test_bad_fields_get_a_400_naming_them(
    change: dict[str, Any], param: str, slots: int
) -> None:
    async with client_for(SimulatorConfig(ttft_ms=1, itl_ms=0, slots=slots)) as (client, _):
        response = await client.post({**chat("hello"), **change})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[-1] in error["message"]


async def test_a_body_that_is_not_an_object_is_refused() -> None:
    async with client_for(SimulatorConfig(ttft_ms=1, itl_ms=0, slots=2)) as (client, _):
        response = await client.http.post(client.url + "/chat/completions", json=[1, 2])
    assert response.status_code == 400
    assert "object" in response.json()["error"]["message"]


@pytest.mark.parametrize("slots", [0, 2])
async def test_fcfs_accepts_and_ignores_a_priority(slots: int) -> None:
    # vLLM 0.32 under its default --scheduling-policy fcfs answers 200 and ignores it.
    async with client_for(SimulatorConfig(ttft_ms=1, itl_ms=0, slots=slots)) as (client, _):
        for body, path in (
            (chat("hello", priority=5), "/chat/completions"),
            ({"model": "m", "prompt": "hello", "priority": -3}, "/completions"),
            ({"model": "m", "input": "hello", "priority": 5}, "/responses"),
            ({"model": "m", "input": "hello", "priority": 5}, "/embeddings"),
        ):
            response = await client.post(body, path=path)
            assert response.status_code == 200, (path, response.text)


async def test_fcfs_serves_in_arrival_order_whatever_the_priority() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=5, output_tokens=200, slots=1)
    async with client_for(config) as (client, _):
        done: list[str] = []

        async def ask(name: str, priority: int, tokens: int = 10) -> None:
            _, data = await client.timed(chat(name, tokens, priority=priority))
            assert data["usage"]["completion_tokens"] == tokens
            done.append(name)

        first = asyncio.create_task(ask("first", 9, 200))  # a second of decoding

        async def busy() -> bool:
            return (await client.metrics())["vllm:num_requests_running"] == 1

        await wait_for(busy)
        later = []
        for name, priority in (("second", 5), ("third", 0), ("fourth", -5)):
            later.append(asyncio.create_task(ask(name, priority)))

            async def queued(n: int = len(later)) -> bool:
                return (await client.metrics())["vllm:num_requests_waiting"] == n

            await wait_for(queued)
        await asyncio.gather(first, *later)
        metrics = await client.metrics()
    assert done == ["first", "second", "third", "fourth"]
    assert metrics["vllm:num_preemptions_total"] == 0


@pytest.mark.parametrize("priority", ["1", 2.0, None])
async def test_priority_scheduling_refuses_a_priority_that_is_not_an_integer(
    priority: Any,
) -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, slots=2, scheduling_policy="priority")
    async with client_for(config) as (client, _):
        response = await client.post(chat("hello", priority=priority))
    # vLLM's request model has ``priority: int = 0``: null is refused too.
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


async def stream_tokens(client: Client, body: dict[str, Any], started: asyncio.Event) -> int:
    """Read a streamed chat answer; set ``started`` at its first token; count its tokens."""
    tokens = 0
    finish = None
    async with client.http.stream("POST", client.url + "/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            tokens += len((choice["delta"].get("content") or "").split())
            finish = choice["finish_reason"] or finish
            if tokens:
                started.set()
    assert finish == "length"
    return tokens


@pytest.mark.parametrize("stream", [True, False])
async def test_kv_pressure_preempts_and_the_victim_still_gets_every_token(stream: bool) -> None:
    # Four blocks of 16 tokens; two answers of 100 tokens cannot both grow in them. The one
    # scheduled last is preempted (fcfs), waits, is prefilled again over its prompt and the
    # tokens it had sent, and ends with all of them. The first one runs on alone past the
    # cache (a request larger than the cache runs when nothing else holds a block).
    config = SimulatorConfig(
        ttft_ms=1, itl_ms=2, output_tokens=1000, slots=2, kv_capacity_tokens=64
    )
    async with client_for(config) as (client, simulator):

        async def answer(name: str) -> int:
            body = chat(name, 100, stream=stream)
            if stream:
                return await stream_tokens(client, body, asyncio.Event())
            _, data = await client.timed(body)
            assert data["choices"][0]["message"]["content"] == " ".join(["tok"] * 100)
            tokens: int = data["usage"]["completion_tokens"]
            return tokens

        tokens = await asyncio.gather(answer("one"), answer("two"))
        metrics = await client.metrics()
    assert list(tokens) == [100, 100]
    assert metrics["vllm:num_preemptions_total"] == 1
    assert metrics["vllm:generation_tokens_total"] == 200
    assert metrics["vllm:time_to_first_token_seconds_count"] == 2
    # Every output token after the first has its inter-token latency, the resumed one too.
    assert metrics["vllm:inter_token_latency_seconds_count"] == 2 * 99
    assert metrics["vllm:request_decode_time_seconds_count"] == 2
    assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert simulator.model is not None
    assert simulator.model.used_blocks() == 0


async def test_step_metrics_are_published_under_vllms_names() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=2, output_tokens=5, slots=4, itl_growth=1.0)
    async with client_for(config) as (client, _):
        await asyncio.gather(*(client.timed(chat(f"q{i}", 5)) for i in range(3)))
        metrics = await client.metrics()
        text = (await client.http.get(client.root + "/metrics")).text
    for name in (
        "vllm:inter_token_latency_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:iteration_tokens_total",
    ):
        assert f"# TYPE {name} histogram" in text
    assert metrics["vllm:inter_token_latency_seconds_count"] == 3 * 4
    # Steps of 2 * (1 + growth * scheduled / slots) ms: every token after the first waited
    # one step, at least 2.5 ms.
    assert metrics["vllm:inter_token_latency_seconds_sum"] >= 12 * 0.0025
    assert metrics["vllm:request_decode_time_seconds_count"] == 3
    assert metrics["vllm:iteration_tokens_total_count"] >= 5
    assert metrics["vllm:iteration_tokens_total_sum"] == 3 * 1 + 3 * 4  # prompts, decodes


async def test_requests_timed_alone_show_their_queue_in_metrics() -> None:
    config = SimulatorConfig(ttft_ms=100, itl_ms=0, max_concurrency=2)
    async with client_for(config) as (client, _):
        requests = [asyncio.create_task(client.timed(chat(f"q{i}"))) for i in range(6)]
        seen: list[dict[str, float]] = []
        while not all(r.done() for r in requests):
            seen.append(await client.metrics())
            await asyncio.sleep(0.01)
        await asyncio.gather(*requests)
        after = await client.metrics()
        stats = await client.stats()
    assert max(m["vllm:num_requests_running"] for m in seen) == 2
    assert max(m["vllm:num_requests_waiting"] for m in seen) >= 1
    assert after["vllm:request_success_total[finished_reason=length]"] == 6
    assert after["vllm:prompt_tokens_total"] == 6
    assert stats["peak_running"] == 2


async def test_many_requests_through_sixty_four_slots() -> None:
    config = SimulatorConfig(ttft_ms=2, itl_ms=1, output_tokens=16, slots=64, itl_growth=1.0)
    async with client_for(config) as (client, simulator):
        replies = await asyncio.gather(*(client.timed(chat(f"r{i}", 32)) for i in range(200)))
        metrics = await client.metrics()
    assert all(data["usage"]["completion_tokens"] == 16 for _, data in replies)
    assert simulator.model is not None
    assert simulator.model.peak_running == 64
    assert metrics["vllm:generation_tokens_total"] == 200 * 16
    assert metrics["vllm:num_requests_running"] == 0
