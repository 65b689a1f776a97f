"""Streamed answers of the simulated engine, read by the OpenAI SDK and by hand."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from backfill.simulator.server import SimulatorConfig
from tests.support import running_simulator

MODELS = {
    "timed alone": SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=5),
    "batched": SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=5, slots=4),
    "batched, prefix cache": SimulatorConfig(
        ttft_ms=1, itl_ms=1, output_tokens=5, slots=4, prefix_cache_blocks=64
    ),
    "no decode time": SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=5, slots=4),
}
PROMPT = " ".join(f"word{i}" for i in range(40))


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_chat_stream_parses_with_the_openai_sdk(name: str) -> None:
    config = MODELS[name]
    async with running_simulator(config) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        contents: list[str] = []
        finishes: list[str | None] = []
        roles: list[str | None] = []
        usages = []
        for _ in range(2):  # the second one can hit the prefix cache
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = ""
            async for chunk in stream:
                assert chunk.object == "chat.completion.chunk"
                assert chunk.model == "sim-model"
                if chunk.choices:
                    choice = chunk.choices[0]
                    text += choice.delta.content or ""
                    roles.append(choice.delta.role)
                    finishes.append(choice.finish_reason)
                else:
                    usages.append(chunk.usage)
            contents.append(text)
        await client.close()
    assert contents == ["tok tok tok tok tok"] * 2
    assert roles[0] == "assistant"
    assert finishes.count("stop") == 2
    assert finishes[-1] == "stop"
    assert len(usages) == 2
    last = usages[-1]
    assert last is not None
    assert (last.prompt_tokens, last.completion_tokens, last.total_tokens) == (40, 5, 45)
    if config.prefix_cache_blocks:
        assert last.prompt_tokens_details is not None
        assert last.prompt_tokens_details.cached_tokens == 32
    else:
        assert last.prompt_tokens_details is None


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_completion_stream_parses_with_the_openai_sdk(name: str) -> None:
    async with running_simulator(MODELS[name]) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        stream = await client.completions.create(
            model="sim-model", prompt="once upon a time", max_tokens=3, stream=True
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == "tok tok tok"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


@pytest.mark.parametrize("slots", [0, 2])
async def test_the_stream_is_server_sent_events_ending_with_done(slots: int) -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=3, slots=slots)
    async with (
        running_simulator(config) as (url, _),
        # httpx's 5 s connect timeout once expired in a full CI run on a loaded machine.
        httpx.AsyncClient(timeout=30) as http,
    ):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply = await http.post(url + "/chat/completions", json=body)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [orjson.loads(e[6:]) for e in events[:-1]]
    assert [p["choices"][0]["delta"] for p in payloads[:3]] == [
        {"role": "assistant", "content": "tok"},
        {"content": " tok"},
        {"content": " tok"},
    ]
    assert all(p["usage"] is None for p in payloads[:3])
    assert payloads[3]["choices"] == []
    assert payloads[3]["usage"]["completion_tokens"] == 3
    assert len({p["id"] for p in payloads}) == 1


@pytest.mark.parametrize("slots", [0, 2])
async def test_an_empty_answer_still_streams_a_finish(slots: int) -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, output_tokens=0, slots=slots)
    async with running_simulator(config) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "say nothing"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    assert [c.choices[0].delta.content for c in chunks[:-1]] == [""]
    assert chunks[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 0


async def test_the_first_token_comes_before_the_last() -> None:
    config = SimulatorConfig(ttft_ms=5, itl_ms=10, output_tokens=30, slots=2)
    async with running_simulator(config) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=30, stream=True
        )
        arrivals = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter() - start)
        await client.close()
    assert len(arrivals) >= 2  # tokens come in several writes, not all at the end
    # 29 decode steps of 10 ms after the first token: the first is far ahead of the last.
    assert arrivals[0] < arrivals[-1] / 4
