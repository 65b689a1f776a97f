"""The simulated engine's media parts, ``/v1/embeddings`` and ``/v1/responses`` over HTTP.

Replies are checked against the ``openai`` package's own types, so the simulator keeps
OpenAI's shapes; no test measures time.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from prometheus_client.parser import text_string_to_metric_families

from backfill.simulator.media import AUDIO_TOKENS, IMAGE_TOKENS
from backfill.simulator.server import SimulatorConfig
from tests.support import running_simulator

MODELS = {
    "timed alone": SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=8),
    "batched": SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=8, slots=4),
}
CACHED = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=8, slots=4, prefix_cache_blocks=256)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(2040)  # 2 KiB: IMAGE_TOKENS + 2 tokens
JPEG = b"\xff\xd8\xff" + bytes(97)  # 100 bytes: IMAGE_TOKENS + 1
WAV = b"RIFF" + bytes(1532)  # 1.5 KiB: AUDIO_TOKENS + 2
WORDS = " ".join(f"word{i}" for i in range(40))


def data_url(media_type: str, raw: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": url}
    if detail is not None:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def chat(content: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


class Client:
    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post(self.url + path, json=body)

    async def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.post(path, body)
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    async def refused(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The error of a 400 in OpenAI's envelope."""
        response = await self.post(path, body)
        assert response.status_code == 400, response.text
        error: dict[str, Any] = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert isinstance(error["message"], str)
        return error

    async def metrics(self) -> dict[str, float]:
        text = (await self.http.get(self.url.removesuffix("/v1") + "/metrics")).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                reason = sample.labels.get("finished_reason")
                out[sample.name + (f"[{reason}]" if reason else "")] = sample.value
        return out


@asynccontextmanager
async def client_for(config: SimulatorConfig) -> AsyncIterator[Client]:
    async with running_simulator(config) as (url, _), httpx.AsyncClient(timeout=30) as http:
        yield Client(url, http)


# ---- media parts in chat ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_media_parts_are_counted_and_reported(name: str) -> None:
    content = [
        {"type": "text", "text": "look at these"},
        image_part(data_url("image/png", PNG), detail="low"),
        image_part(data_url("image/jpeg", JPEG)),
        {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}},
        {"type": "text", "text": "and listen"},
    ]
    async with client_for(MODELS[name]) as client:
        data = await client.ok("/chat/completions", chat(content, max_tokens=4))
    ChatCompletion.model_validate(data)
    assert data["backfill_simulator"] == {
        "received": {
            "images": 2,
            "image_bytes": len(PNG) + len(JPEG),
            "audio": 1,
            "audio_bytes": len(WAV),
            "image_types": ["image/png", "image/jpeg"],
            "audio_formats": ["wav"],
        }
    }
    media = (IMAGE_TOKENS + 2) + (IMAGE_TOKENS + 1) + (AUDIO_TOKENS + 2)
    assert data["usage"]["prompt_tokens"] == 5 + media
    assert data["choices"][0]["message"]["content"] == "tok tok tok tok"


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
async def test_a_text_prompt_reports_that_nothing_came(path: str) -> None:
    body = chat("just words") if path == "/chat/completions" else {"model": "m", "prompt": "hi"}
    async with client_for(MODELS["batched"]) as client:
        data = await client.ok(path, body)
    assert data["backfill_simulator"]["received"] == {
        "images": 0,
        "image_bytes": 0,
        "audio": 0,
        "audio_bytes": 0,
        "image_types": [],
        "audio_formats": [],
    }


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_a_stream_reports_what_came_in_its_first_chunk(name: str) -> None:
    content = [{"type": "text", "text": "hi"}, image_part(data_url("image/png", PNG))]
    async with client_for(MODELS[name]) as client:
        reply = await client.post("/chat/completions", chat(content, stream=True, max_tokens=3))
    events = [orjson.loads(e[6:]) for e in reply.text.split("\n\n") if e and "[DONE]" not in e]
    assert events[0]["backfill_simulator"]["received"]["images"] == 1
    assert all("backfill_simulator" not in e for e in events[1:])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "tok tok tok"


async def test_the_openai_sdk_sends_media_parts_the_simulator_reads() -> None:
    async with running_simulator(MODELS["timed alone"]) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        completion = await client.chat.completions.create(
            model="sim-model",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it"},
                        {"type": "image_url", "image_url": {"url": data_url("image/png", PNG)}},
                        {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "mp3"}},
                    ],
                }
            ],
        )
        await client.close()
    extra = completion.model_extra or {}
    received = extra["backfill_simulator"]["received"]
    assert (received["images"], received["audio"]) == (1, 1)
    assert received["audio_formats"] == ["mp3"]


async def test_the_same_image_is_served_from_the_prefix_cache() -> None:
    def ask(raw: bytes) -> dict[str, Any]:
        return chat([image_part(data_url("image/png", raw)), {"type": "text", "text": WORDS}])

    other = PNG[:-1] + b"\x01"  # same size, other bytes
    async with client_for(CACHED) as client:
        first = await client.ok("/chat/completions", ask(PNG))
        again = await client.ok("/chat/completions", ask(PNG))
        changed = await client.ok("/chat/completions", ask(other))
    tokens = IMAGE_TOKENS + 2 + 40
    assert first["usage"]["prompt_tokens"] == tokens
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (tokens - 1) // 16 * 16
    # The image comes first: another image shares no block with it.
    assert changed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("scheme", ["https", "http", "HTTPS"])
async def test_an_image_url_to_fetch_is_refused(scheme: str) -> None:
    content = [{"type": "text", "text": "hi"}, image_part(f"{scheme}://example.com/cat.png")]
    async with client_for(MODELS["batched"]) as client:
        error = await client.refused("/chat/completions", chat(content))
        stats = (await client.http.get(client.url.removesuffix("/v1") + "/stats")).json()
    assert "does not fetch URLs" in error["message"]
    assert error["param"] == "messages[0].content[1].image_url.url"
    assert stats["by_status"] == {"400": 1}


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        (image_part("data:image/png;base64,not base64!"), "image_url.url", "base64"),
        (image_part(data_url("text/plain", b"hello")), "image_url.url", "not an image"),
        (image_part("data:image/png,raw-bytes"), "image_url.url", "base64"),
        (image_part("data:image/png;base64,"), "image_url.url", "empty"),
        (image_part("data:image/png;base64"), "image_url.url", "comma"),
        (image_part("ftp://example.com/a.png"), "image_url.url", "data: URL"),
        (image_part(data_url("image/png", PNG), detail="huge"), "image_url.detail", "detail"),
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "image_url", "url"),
        (
            {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
            "input_audio.data",
            "base64",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "flac"}},
            "input_audio.format",
            "wav or mp3",
        ),
        ({"type": "video_url", "video_url": {"url": "x"}}, "type", "video_url"),
        ({"type": "text", "text": 5}, "text", "string"),
    ],
)
async def test_a_bad_media_part_is_refused(part: dict[str, Any], param: str, words: str) -> None:
    async with client_for(MODELS["timed alone"]) as client:
        error = await client.refused("/chat/completions", chat([part]))
    assert error["param"] == f"messages[0].content[0].{param}"
    assert words in error["message"]


# ---- /v1/embeddings -----------------------------------------------------------------------


def embed(input_: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-embed", "input": input_, **extra}


def norm(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_embeddings_have_openais_shape(name: str) -> None:
    async with client_for(MODELS[name]) as client:
        one = await client.ok("/embeddings", embed("hello there world"))
        many = await client.ok("/embeddings", embed(["a b", "c", "d e f"], user="u-1"))
        ids = await client.ok("/embeddings", embed([1, 2, 3, 4]))
        lists = await client.ok("/embeddings", embed([[1, 2], [3]]))
    for data in (one, many, ids, lists):
        parsed = CreateEmbeddingResponse.model_validate(data)
        assert set(data) == {"object", "data", "model", "usage"}
        assert parsed.model == "sim-embed"
        assert [e.index for e in parsed.data] == list(range(len(parsed.data)))
        for item in parsed.data:
            assert len(item.embedding) == 64
            assert norm(item.embedding) == pytest.approx(1.0, abs=1e-6)
    assert [len(d["data"]) for d in (one, many, ids, lists)] == [1, 3, 1, 2]
    assert one["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert many["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert ids["usage"]["prompt_tokens"] == 4
    assert lists["usage"]["prompt_tokens"] == 3


async def test_embeddings_are_deterministic_and_tell_inputs_apart() -> None:
    async with client_for(MODELS["batched"]) as client:
        first = await client.ok("/embeddings", embed(["same", "other", "same"]))
        again = await client.ok("/embeddings", embed("same"))
        ids = await client.ok("/embeddings", embed([[7, 8], [7, 9], [7, 8]]))
    vectors = [item["embedding"] for item in first["data"]]
    assert vectors[0] == vectors[2] == again["data"][0]["embedding"]
    assert vectors[0] != vectors[1]
    by_ids = [item["embedding"] for item in ids["data"]]
    assert by_ids[0] == by_ids[2] != by_ids[1]


async def test_base64_embeddings_decode_to_the_same_floats() -> None:
    async with client_for(MODELS["timed alone"]) as client:
        floats = await client.ok("/embeddings", embed(["x y", "z"], encoding_format="float"))
        packed = await client.ok("/embeddings", embed(["x y", "z"], encoding_format="base64"))
    CreateEmbeddingResponse.model_validate(floats)
    for as_floats, as_base64 in zip(floats["data"], packed["data"], strict=True):
        raw = base64.b64decode(as_base64["embedding"])
        assert len(raw) == 4 * 64
        assert list(struct.unpack("<64f", raw)) == as_floats["embedding"]


async def test_the_openai_sdk_reads_embeddings() -> None:
    # The SDK asks for base64 by default and decodes it itself.
    async with running_simulator(MODELS["batched"]) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        packed = await client.embeddings.create(model="sim-embed", input=["p", "q"])
        floats = await client.embeddings.create(
            model="sim-embed", input=["p", "q"], encoding_format="float"
        )
        await client.close()
    assert [e.embedding for e in packed.data] == [e.embedding for e in floats.data]
    assert packed.usage.prompt_tokens == 2


async def test_fewer_dimensions_truncate_the_vector_then_normalise_it() -> None:
    async with client_for(MODELS["timed alone"]) as client:
        full = (await client.ok("/embeddings", embed("a text")))["data"][0]["embedding"]
        short = (await client.ok("/embeddings", embed("a text", dimensions=8)))["data"][0]
    head = full[:8]
    assert len(short["embedding"]) == 8
    assert norm(short["embedding"]) == pytest.approx(1.0, abs=1e-6)
    assert short["embedding"] == pytest.approx([v / norm(head) for v in head], rel=1e-5)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": ""}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": [[1, -2]]}, "input[0]"),
        ({"input": [[1, "2"]]}, "input[0]"),
        ({"input": ["a"] * 2049}, "input"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 65}, "dimensions"),
        ({"dimensions": "8"}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"user": 3}, "user"),
        ({"model": None}, "model"),
        ({"normalize": True}, "normalize"),
        ({"priority": 1.5}, "priority"),
    ],
)
async def test_bad_embedding_requests_are_refused(change: dict[str, Any], param: str) -> None:
    async with client_for(MODELS["timed alone"]) as client:
        error = await client.refused("/embeddings", {**embed("fine"), **change})
    assert error["param"] == param


async def test_embeddings_are_prefill_only_requests_of_the_engine() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=1, slots=2, prefix_cache_blocks=64)
    async with client_for(config) as client:
        await client.ok("/embeddings", embed([WORDS, WORDS + " tail", "short one"]))
        await client.ok("/embeddings", embed(WORDS))
        metrics = await client.metrics()
        stats = (await client.http.get(client.url.removesuffix("/v1") + "/stats")).json()
    # Each input is a sequence of its own; none decodes.
    assert metrics["vllm:request_success_total[stop]"] == 4
    assert metrics["vllm:generation_tokens_total"] == 0
    assert metrics["vllm:prompt_tokens_total"] == 40 + 41 + 2 + 40
    assert metrics["vllm:prefix_cache_hits_total"] > 0  # the repeated text's blocks
    assert stats["peak_running"] <= 2
    assert stats["models"] == {"sim-embed": 2}


# ---- /v1/responses ------------------------------------------------------------------------


def respond(input_: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "input": input_, **extra}


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_a_response_has_openais_shape(name: str) -> None:
    body = respond(
        "tell me a story",
        instructions="be brief",
        temperature=0.5,
        top_p=0.9,
        metadata={"run": "1"},
        store=False,
        user="u-1",
    )
    async with client_for(MODELS[name]) as client:
        data = await client.ok("/responses", body)
    response = Response.model_validate(data)
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.incomplete_details is None
    assert response.model == "sim-model"
    assert response.output_text == " ".join(["tok"] * 8)
    message = response.output[0]
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    assert (response.instructions, response.temperature, response.top_p) == ("be brief", 0.5, 0.9)
    assert response.metadata == {"run": "1"}
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (6, 8, 14)
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert data["backfill_simulator"]["received"]["images"] == 0


async def test_response_input_items_carry_text_and_images() -> None:
    items = [
        {"role": "system", "content": "one two"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what is this"},
                {"type": "input_image", "image_url": data_url("image/png", PNG), "detail": "auto"},
            ],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "a picture"}]},
    ]
    async with client_for(MODELS["batched"]) as client:
        data = await client.ok("/responses", respond(items))
    Response.model_validate(data)
    assert data["usage"]["input_tokens"] == 2 + 3 + (IMAGE_TOKENS + 2) + 2
    received = data["backfill_simulator"]["received"]
    assert (received["images"], received["image_bytes"]) == (1, len(PNG))


async def test_max_output_tokens_cuts_the_answer_short() -> None:
    async with client_for(MODELS["batched"]) as client:
        short = await client.ok("/responses", respond("go on", max_output_tokens=3))
        roomy = await client.ok("/responses", respond("go on", max_output_tokens=100))
        few = await client.ok("/responses", respond("[[sim:tokens=2]] go on"))
    cut = Response.model_validate(short)
    assert cut.output_text == "tok tok tok"
    assert cut.usage is not None
    assert cut.usage.output_tokens == 3
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.max_output_tokens == 3
    assert (roomy["status"], roomy["usage"]["output_tokens"]) == ("completed", 8)
    assert few["usage"]["output_tokens"] == 2


async def test_the_openai_sdk_reads_a_response() -> None:
    async with running_simulator(MODELS["batched"]) as (url, _):
        client = AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)
        response = await client.responses.create(
            model="sim-model", input="hello", max_output_tokens=16
        )
        await client.close()
    assert response.output_text == " ".join(["tok"] * 8)
    assert response.usage is not None
    assert response.usage.input_tokens == 1


async def test_responses_use_the_prefix_cache() -> None:
    async with client_for(CACHED) as client:
        first = await client.ok("/responses", respond(WORDS, instructions="sys"))
        again = await client.ok("/responses", respond(WORDS, instructions="sys"))
    # 41 tokens: two full blocks of 16 enter the cache, and are found the second time.
    assert first["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 32}
    assert again["usage"]["input_tokens"] == 41
    assert again["usage"]["input_tokens_details"] == {"cached_tokens": 32, "cache_write_tokens": 0}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": True}, "stream"),
        ({"background": True}, "background"),
        ({"stream": "no"}, "stream"),
        ({"tools": []}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": "high"}, "top_p"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"store": "yes"}, "store"),
        ({"instructions": 5}, "instructions"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}
                ]
            },
            "input[0].content[0].file_id",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": "https://example.com/a.png"}
                        ],
                    }
                ]
            },
            "input[0].content[0].image_url",
        ),
    ],
)
async def test_bad_response_requests_are_refused(change: dict[str, Any], param: str) -> None:
    async with client_for(MODELS["timed alone"]) as client:
        error = await client.refused("/responses", {**respond("hi"), **change})
    assert error["param"] == param


async def test_responses_obey_fault_directives() -> None:
    async with client_for(MODELS["batched"]) as client:
        failed = await client.post("/responses", respond("[[sim:status=503]]"))
    assert failed.status_code == 503


# ---- the rest still works -----------------------------------------------------------------


async def test_models_lists_the_served_model() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, model_name="org/served")
    async with client_for(config) as client:
        data = (await client.http.get(client.url + "/models")).json()
    assert data == {"object": "list", "data": [{"id": "org/served", "object": "model"}]}


async def test_a_body_that_is_not_json_is_refused_everywhere() -> None:
    async with client_for(MODELS["timed alone"]) as client:
        for path in ("/chat/completions", "/responses", "/embeddings"):
            reply = await client.http.post(client.url + path, content=b"{not json")
            assert reply.status_code == 400
            assert "JSON" in reply.json()["error"]["message"]
