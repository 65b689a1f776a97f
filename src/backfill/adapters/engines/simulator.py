"""A simulated OpenAI-compatible engine for load and fault tests. It runs no model.

Latency is ``ttft_ms + itl_ms * output tokens``. Faults come at random rates, or on demand from
a directive in the prompt text, which makes tests deterministic:
``[[sim:status=400]]``, ``[[sim:status=503]]``, ``[[sim:drop]]``, ``[[sim:hang]]``,
``[[sim:delay_ms=2000]]``, ``[[sim:tokens=5]]``, ``[[sim:fail_first=2]]`` (fail with 503 the
first two times this prompt is seen).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

_DIRECTIVE = re.compile(r"\[\[sim:([a-z_]+)(?:=([0-9]+))?\]\]")


@dataclass
class SimulatorConfig:
    ttft_ms: float = 50.0
    itl_ms: float = 1.0
    output_tokens: int = 64
    max_concurrency: int = 0
    error_rate: float = 0.0
    rate_limit_rate: float = 0.0
    drop_rate: float = 0.0
    seed: int | None = None


@dataclass
class SimulatorStats:
    requests: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else str(prompt)


class Simulator:
    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.stats = SimulatorStats()
        self._random = random.Random(config.seed)
        self._seen: Counter[str] = Counter()
        self._slots = (
            asyncio.Semaphore(config.max_concurrency) if config.max_concurrency > 0 else None
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "simulated", "object": "model"}]}
        )

    async def _stats(self, _: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "requests": s.requests,
                "in_flight": s.in_flight,
                "peak_in_flight": s.peak_in_flight,
                "by_status": {str(k): v for k, v in s.by_status.items()},
                "models": dict(s.models),
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self.stats.requests += 1
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return self._error(400, "request body is not JSON")
        text = _prompt_text(body)
        directives = {m.group(1): m.group(2) for m in _DIRECTIVE.finditer(text)}
        self.stats.models[str(body.get("model"))] += 1
        fault = self._fault(request, text, directives)
        if fault is not None:
            response: web.StreamResponse = await fault
            return response
        if self._slots is not None:
            async with self._slots:
                return await self._answer(body, text, directives, chat)
        return await self._answer(body, text, directives, chat)

    def _fault(self, request: web.Request, text: str, directives: dict[str, str | None]) -> Any:
        if "fail_first" in directives:
            self._seen[text] += 1
            if self._seen[text] <= int(directives["fail_first"] or 1):
                return self._async(self._error(503, "simulated overload"))
        if "status" in directives:
            status = int(directives["status"] or 500)
            return self._async(self._error(status, f"simulated status {status}"))
        if "drop" in directives:
            return self._drop(request)
        if "hang" in directives:
            return self._hang()
        roll = self._random.random()
        c = self.config
        if roll < c.error_rate:
            return self._async(self._error(500, "simulated server error"))
        if roll < c.error_rate + c.rate_limit_rate:
            return self._async(self._error(429, "simulated rate limit", retry_after="0.05"))
        if roll < c.error_rate + c.rate_limit_rate + c.drop_rate:
            return self._drop(request)
        return None

    @staticmethod
    async def _async(response: web.Response) -> web.Response:
        return response

    async def _drop(self, request: web.Request) -> web.Response:
        # Close the socket without an answer, as a crashed engine would.
        if request.transport is not None:
            request.transport.abort()
        self.stats.by_status[0] += 1
        return web.Response(status=500)

    async def _hang(self) -> web.Response:
        await asyncio.sleep(3600)
        return self._error(504, "unreachable")

    def _error(self, status: int, message: str, retry_after: str | None = None) -> web.Response:
        self.stats.by_status[status] += 1
        headers = {"Retry-After": retry_after} if retry_after else None
        return web.json_response(
            {"error": {"message": message, "type": "simulated", "code": status}},
            status=status,
            headers=headers,
        )

    async def _answer(
        self, body: dict[str, Any], text: str, directives: dict[str, str | None], chat: bool
    ) -> web.Response:
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            tokens = min(int(directives.get("tokens") or self.config.output_tokens), int(limit))
            delay_ms = float(directives.get("delay_ms") or 0)
            await asyncio.sleep(
                (self.config.ttft_ms + self.config.itl_ms * tokens + delay_ms) / 1000
            )
        finally:
            stats.in_flight -= 1
        prompt_tokens = max(1, len(text.split()))
        content = " ".join(["tok"] * tokens)
        created = int(time.time())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
        finish = "length" if tokens >= int(limit) else "stop"
        if chat:
            payload: dict[str, Any] = {
                "id": f"chatcmpl-sim{stats.requests}",
                "object": "chat.completion",
                "created": created,
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
        else:
            payload = {
                "id": f"cmpl-sim{stats.requests}",
                "object": "text_completion",
                "created": created,
                "model": body.get("model"),
                "choices": [{"index": 0, "text": content, "finish_reason": finish}],
                "usage": usage,
            }
        stats.by_status[200] += 1
        return web.Response(body=orjson.dumps(payload), content_type="application/json")


def run_simulator(config: SimulatorConfig, host: str, port: int) -> None:
    web.run_app(Simulator(config).app(), host=host, port=port, print=None, access_log=None)
