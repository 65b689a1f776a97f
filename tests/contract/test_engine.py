"""One contract for every ``Engine`` adapter, plus the HTTP adapter's error mapping (SPEC §9.2)."""

from __future__ import annotations

import asyncio
import email.utils
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from backfill.adapters.engines.fake import FakeEngine
from backfill.adapters.engines.openai_http import OpenAIHttpEngine, parse_retry_after
from backfill.ports import Engine, EngineDiagnostics, EngineTimeout, EngineUnreachable
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import free_port, recording_simulator, running_simulator
from tests.tls_support import make_pki

CATALOG_NAME = "catalog-model"
SERVED_NAME = "served-model"
CHAT = "/v1/chat/completions"


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": CATALOG_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


@dataclass
class EngineCase:
    engine: Engine
    served_name: str
    """The model name the engine's server is asked for."""
    seen_models: Callable[[], dict[str, int]]
    """Model names the engine's server received, with counts."""


def _fake(_: tuple[str, Simulator]) -> EngineCase:
    engine = FakeEngine("fake", models=(CATALOG_NAME,))

    def seen() -> dict[str, int]:
        counts: dict[str, int] = {}
        for _path, body in engine.calls:
            counts[body["model"]] = counts.get(body["model"], 0) + 1
        return counts

    # The fake serves the catalog name as is.
    return EngineCase(engine, CATALOG_NAME, seen)


def _http(sim: tuple[str, Simulator]) -> EngineCase:
    url, simulator = sim
    engine = OpenAIHttpEngine("sim", url, {CATALOG_NAME: SERVED_NAME}, request_timeout_s=10.0)
    return EngineCase(engine, SERVED_NAME, lambda: dict(simulator.stats.models))


ENGINES: dict[str, Callable[[tuple[str, Simulator]], EngineCase]] = {
    "fake": _fake,
    "openai_http": _http,
}


@pytest.fixture(params=sorted(ENGINES))
async def case(
    request: pytest.FixtureRequest, sim: tuple[str, Simulator]
) -> AsyncIterator[EngineCase]:
    made = ENGINES[request.param](sim)
    try:
        yield made
    finally:
        await made.engine.close()


@pytest.fixture
async def http_engine(sim: tuple[str, Simulator]) -> AsyncIterator[OpenAIHttpEngine]:
    engine = OpenAIHttpEngine("sim", sim[0], {CATALOG_NAME: SERVED_NAME}, request_timeout_s=10.0)
    try:
        yield engine
    finally:
        await engine.close()


def error_body(body: bytes) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(body)
    return data


# ---- the contract -----------------------------------------------------------------------


async def test_serves_only_its_models(case: EngineCase) -> None:
    assert case.engine.serves(CATALOG_NAME)
    assert not case.engine.serves("some-other-model")
    assert case.engine.name
    assert case.engine.max_concurrency >= 1


async def test_send_returns_a_chat_completion_with_usage(case: EngineCase) -> None:
    reply = await case.engine.send(CHAT, CATALOG_NAME, chat_body())
    assert reply.status == 200
    body = orjson.loads(reply.body)
    assert body["object"] == "chat.completion"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    usage = body["usage"]
    assert all(isinstance(usage[k], int) for k in ("prompt_tokens", "completion_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 8


async def test_send_renames_the_model_to_the_served_name(case: EngineCase) -> None:
    body = chat_body()
    reply = await case.engine.send(CHAT, CATALOG_NAME, body)
    assert reply.status == 200
    assert case.seen_models() == {case.served_name: 1}
    # The caller's body is not changed: a retry sends the same line again.
    assert body == chat_body()


async def test_max_tokens_is_passed_on(case: EngineCase) -> None:
    reply = await case.engine.send(CHAT, CATALOG_NAME, chat_body(max_tokens=1))
    assert orjson.loads(reply.body)["usage"]["completion_tokens"] == 1


async def test_stream_flag_still_gets_one_json_answer(case: EngineCase) -> None:
    reply = await case.engine.send(CHAT, CATALOG_NAME, chat_body(stream=True))
    assert reply.status == 200
    assert orjson.loads(reply.body)["object"] == "chat.completion"


async def test_healthy(case: EngineCase) -> None:
    assert await case.engine.healthy() is True


async def test_many_sends_in_a_row(case: EngineCase) -> None:
    for i in range(5):
        reply = await case.engine.send(CHAT, CATALOG_NAME, chat_body(f"question {i}"))
        assert reply.status == 200
    assert case.seen_models() == {case.served_name: 5}


# ---- the HTTP adapter -------------------------------------------------------------------


async def test_http_model_rename_reaches_the_engine(
    http_engine: OpenAIHttpEngine, sim: tuple[str, Simulator]
) -> None:
    reply = await http_engine.send(CHAT, CATALOG_NAME, chat_body())
    assert orjson.loads(reply.body)["model"] == SERVED_NAME
    assert sim[1].stats.models[SERVED_NAME] == 1
    assert sim[1].stats.models[CATALOG_NAME] == 0


async def test_http_priority_setting_is_sent_with_every_request() -> None:
    # vLLM takes it under either policy (fcfs ignores it); the engine saw it each time.
    fcfs = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4)
    queue = SimulatorConfig(
        ttft_ms=1, itl_ms=0, output_tokens=4, slots=4, scheduling_policy="priority"
    )
    for config in (fcfs, queue):
        async with recording_simulator(config) as (url, _, attempts):
            engine = OpenAIHttpEngine("sim", url, {CATALOG_NAME: SERVED_NAME}, priority=5)
            try:
                reply = await engine.send(CHAT, CATALOG_NAME, chat_body())
            finally:
                await engine.close()
        assert reply.status == 200, reply.body
        assert [a.priority for a in attempts] == [5]


async def test_http_completions_endpoint(http_engine: OpenAIHttpEngine) -> None:
    body = {"model": CATALOG_NAME, "prompt": "once upon a time", "max_tokens": 4}
    reply = await http_engine.send("/v1/completions", CATALOG_NAME, body)
    assert reply.status == 200
    assert orjson.loads(reply.body)["object"] == "text_completion"


async def test_http_base_url_without_v1(sim: tuple[str, Simulator]) -> None:
    root = sim[0].removesuffix("/v1")
    engine = OpenAIHttpEngine("sim", root + "/", {CATALOG_NAME: SERVED_NAME})
    try:
        assert await engine.healthy()
        reply = await engine.send(CHAT, CATALOG_NAME, chat_body())
        assert reply.status == 200
    finally:
        await engine.close()


@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
async def test_http_error_status_comes_back_with_the_engine_body(
    http_engine: OpenAIHttpEngine, status: int
) -> None:
    reply = await http_engine.send(CHAT, CATALOG_NAME, chat_body(f"[[sim:status={status}]]"))
    assert reply.status == status
    assert error_body(reply.body)["error"]["message"] == f"simulated status {status}"
    assert reply.retry_after_s is None


async def test_http_rate_limit_carries_retry_after() -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4, rate_limit_rate=1.0)
    async with running_simulator(config) as (url, simulator):
        engine = OpenAIHttpEngine("sim", url, {CATALOG_NAME: SERVED_NAME})
        try:
            reply = await engine.send(CHAT, CATALOG_NAME, chat_body())
        finally:
            await engine.close()
    assert reply.status == 429
    assert reply.retry_after_s == pytest.approx(0.05)
    assert error_body(reply.body)["error"]["message"] == "simulated rate limit"
    assert simulator.stats.by_status[429] == 1


async def test_http_dropped_connection_is_unreachable(http_engine: OpenAIHttpEngine) -> None:
    with pytest.raises(EngineUnreachable):
        await http_engine.send(CHAT, CATALOG_NAME, chat_body("[[sim:drop]]"))
    # The adapter recovers: the next request gets a fresh connection.
    assert (await http_engine.send(CHAT, CATALOG_NAME, chat_body())).status == 200


@asynccontextmanager
async def impatient_simulator() -> AsyncIterator[str]:
    """A simulator whose shutdown cancels hanging handlers instead of waiting a minute."""
    simulator = Simulator(SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4))
    runner = web.AppRunner(
        simulator.app(), access_log=None, shutdown_timeout=0.1, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", free_port())
    await site.start()
    try:
        yield site.name.rstrip("/") + "/v1"
    finally:
        await runner.cleanup()


async def test_http_hang_times_out() -> None:
    async with impatient_simulator() as url:
        engine = OpenAIHttpEngine("sim", url, {CATALOG_NAME: SERVED_NAME}, request_timeout_s=0.3)
        await _hang_times_out(engine)


async def _hang_times_out(engine: OpenAIHttpEngine) -> None:
    try:
        with pytest.raises(EngineTimeout):
            await engine.send(CHAT, CATALOG_NAME, chat_body("[[sim:hang]]"))
        assert (await engine.send(CHAT, CATALOG_NAME, chat_body())).status == 200
    finally:
        await engine.close()


async def test_http_closed_port_is_unhealthy_and_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    engine = OpenAIHttpEngine("dead", url, {CATALOG_NAME: SERVED_NAME}, connect_timeout_s=2.0)
    try:
        assert await engine.healthy() is False
        with pytest.raises(EngineUnreachable):
            await engine.send(CHAT, CATALOG_NAME, chat_body())
    finally:
        await engine.close()


async def test_http_health_error_says_why_in_words_for_an_operator(
    http_engine: OpenAIHttpEngine,
) -> None:
    assert await http_engine.healthy()
    assert http_engine.health_error is None
    closed = free_port()
    dead = OpenAIHttpEngine("dead", f"http://127.0.0.1:{closed}/v1", {CATALOG_NAME: SERVED_NAME})
    try:
        assert await dead.healthy() is False
        assert dead.health_error == f"cannot connect to 127.0.0.1:{closed} (connection refused)"
    finally:
        await dead.close()


async def test_http_health_error_names_the_status_of_a_server_without_v1_models() -> None:
    async def nothing_here(_: web.Request) -> web.Response:
        return web.Response(status=404, text="not found")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", nothing_here)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engine = OpenAIHttpEngine("web", f"http://127.0.0.1:{port}", {CATALOG_NAME: SERVED_NAME})
    try:
        assert await engine.healthy() is False
        assert engine.health_error == (
            "GET /v1/models answered HTTP 404 (is base_url the root of an OpenAI-compatible "
            "server?)"
        )
    finally:
        await engine.close()
        await runner.cleanup()


@asynccontextmanager
async def https_server(context: ssl.SSLContext | None) -> AsyncIterator[int]:
    """A server answering ``GET /v1/models`` over TLS with the test CA's certificate for
    127.0.0.1 (plain HTTP when ``context`` is None); yields its port."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_http_health_error_names_a_certificate_the_engine_does_not_trust() -> None:
    """A certificate from a CA the system does not trust fails the TLS handshake; the reason
    says so in OpenSSL's words, not as an OS error (its errno is OpenSSL's code)."""
    async with https_server(make_pki().server_context()) as port:
        engine = OpenAIHttpEngine("tls", f"https://127.0.0.1:{port}/v1", {CATALOG_NAME: "m"})
        try:
            assert await engine.healthy() is False
            reason = engine.health_error
        finally:
            await engine.close()
    assert reason == (
        f"TLS handshake with 127.0.0.1:{port} failed: certificate verify failed (unable to get "
        "local issuer certificate)"
    )


async def test_http_health_error_names_a_port_that_does_not_speak_tls() -> None:
    """``https://`` to a plain HTTP port: OpenSSL's words, without its codes."""
    async with https_server(None) as port:
        engine = OpenAIHttpEngine("tls", f"https://127.0.0.1:{port}/v1", {CATALOG_NAME: "m"})
        try:
            assert await engine.healthy() is False
            reason = engine.health_error
        finally:
            await engine.close()
    assert reason is not None
    assert reason.startswith(f"TLS handshake with 127.0.0.1:{port} failed: "), reason
    assert "[SSL" not in reason, reason
    assert "_ssl.c" not in reason, reason
    assert "not permitted" not in reason, reason


_HEALTH_CHECK = """
import asyncio, sys
from backfill.adapters.engines.openai_http import OpenAIHttpEngine

async def main() -> None:
    engine = OpenAIHttpEngine("tls", sys.argv[1], {"m": "m"})
    healthy = await engine.healthy()
    await engine.close()
    print(healthy, engine.health_error)

asyncio.run(main())
"""


async def test_http_engine_behind_tls_is_healthy_once_its_ca_is_trusted(tmp_path: Path) -> None:
    """The fix for an untrusted certificate (docs/deployment.md): trust the engine's CA the
    system's way, with SSL_CERT_FILE in the worker's environment (read as the process starts,
    hence a process of its own)."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(make_pki().ca_pem)
    async with https_server(make_pki().server_context()) as port:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HEALTH_CHECK,
            f"https://127.0.0.1:{port}/v1",
            env={**os.environ, "SSL_CERT_FILE": str(ca)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, out.decode()
    assert out.decode().split() == ["True", "None"]


def test_http_url_shows_no_credentials() -> None:
    engine = OpenAIHttpEngine(
        "e", "https://user:secret@gpu.example:8443/v1?token=abc#x", {CATALOG_NAME: SERVED_NAME}
    )
    assert engine.url == "https://gpu.example:8443/v1"
    assert isinstance(engine, EngineDiagnostics)
    assert not isinstance(FakeEngine(), EngineDiagnostics)


async def test_http_close_is_idempotent(http_engine: OpenAIHttpEngine) -> None:
    await http_engine.close()
    await http_engine.close()


def test_parse_retry_after_seconds() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.05") == pytest.approx(0.05)
    assert parse_retry_after("0") == 0.0
    assert parse_retry_after("-5") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("soon") is None


def test_parse_retry_after_http_date() -> None:
    future = email.utils.formatdate(time.time() + 120, usegmt=True)
    seconds = parse_retry_after(future)
    assert seconds is not None
    assert 100 <= seconds <= 121
    past = email.utils.formatdate(time.time() - 3600, usegmt=True)
    assert parse_retry_after(past) == 0.0


@pytest.mark.parametrize("url", ["", "localhost:8000/v1", "ftp://engine/v1"])
async def test_http_base_url_no_request_can_use_is_unreachable_not_a_crash(url: str) -> None:
    engine = OpenAIHttpEngine("bad", url, {CATALOG_NAME: SERVED_NAME})
    try:
        with pytest.raises(EngineUnreachable, match="not an http"):
            await engine.send(CHAT, CATALOG_NAME, chat_body())
        assert await engine.healthy() is False
    finally:
        await engine.close()
