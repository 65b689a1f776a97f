"""A simulated OpenAI-compatible engine for load and fault tests. It runs no model.

Two timing models (``docs/simulator.md`` has the formulas and every option):

- by default each request is timed alone: ``ttft_ms + itl_ms * output tokens``, optionally
  capped at ``max_concurrency`` requests at a time;
- with ``slots > 0``, continuous batching as in vLLM (``sim_model``): a FIFO queue for slots,
  prefill per uncached prompt token, one decode step loop whose steps slow down as more
  sequences run, an optional prefix cache, and optionally vLLM's priority scheduling (a
  request's ``priority`` orders the queue and preempts running requests of worse priority).

Prompt tokens are the whitespace-separated words of the prompt text. Both models stream
(``"stream": true``) and publish vLLM's metric names on ``/metrics``.

Faults come at random rates, or on demand from a directive in the prompt text, which makes
tests deterministic: ``[[sim:status=400]]``, ``[[sim:status=503]]``, ``[[sim:drop]]``,
``[[sim:hang]]``, ``[[sim:delay_ms=2000]]``, ``[[sim:tokens=5]]``, ``[[sim:fail_first=2]]``
(fail with 503 the first two times this prompt is seen).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

from backfill.adapters.engines import sim_replies
from backfill.adapters.engines.sim_engine import EngineLoop, Ticket
from backfill.adapters.engines.sim_metrics import EngineSnapshot, render
from backfill.adapters.engines.sim_model import BatchingConfig, BatchingModel, Phase, Sequence
from backfill.adapters.engines.sim_prefix_cache import block_hashes

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
    slots: int = 0
    """0: each request timed alone (``max_concurrency`` may cap them); > 0: continuous
    batching with this many sequence slots."""
    prefill_ms_per_token: float = 0.0
    itl_growth: float = 0.0
    kv_capacity_tokens: int = 262_144
    block_tokens: int = 16
    prefix_cache_blocks: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's ``--scheduling-policy``: ``fcfs`` refuses a request whose priority is not 0;
    ``priority`` (needs slots) serves lower priority values first and preempts."""
    model_name: str = "simulated"

    def __post_init__(self) -> None:
        if self.slots < 0 or self.max_concurrency < 0:
            raise ValueError("slots and max_concurrency must not be negative")
        if self.slots and self.max_concurrency:
            raise ValueError("slots replaces max_concurrency: set one of them, not both")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        batched_only = {
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "itl_growth": self.itl_growth,
            "prefix_cache_blocks": self.prefix_cache_blocks,
            "scheduling_policy=priority": self.scheduling_policy == "priority",
        }
        unused = [name for name, value in batched_only.items() if value and not self.slots]
        if unused:
            raise ValueError(f"{', '.join(unused)} only act with slots > 0")
        self.batching()  # the model checks its own ranges

    def batching(self) -> BatchingConfig | None:
        if not self.slots:
            return None
        return BatchingConfig(
            slots=self.slots,
            ttft_ms=self.ttft_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            itl_ms=self.itl_ms,
            itl_growth=self.itl_growth,
            kv_capacity_tokens=self.kv_capacity_tokens,
            block_tokens=self.block_tokens,
            prefix_cache_blocks=self.prefix_cache_blocks,
            priority_scheduling=self.scheduling_policy == "priority",
        )


@dataclass
class SimulatorStats:
    requests: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class _Ask:
    """What a valid request body asks for."""

    limit: int
    tokens: int
    stream: bool
    include_usage: bool
    priority: int = 0

    @property
    def finish_reason(self) -> str:
        return "length" if self.tokens >= self.limit else "stop"


class _BadRequest(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


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


def _ask(
    body: dict[str, Any],
    directives: dict[str, str | None],
    output_tokens: int,
    priority_scheduling: bool = False,
) -> _Ask:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise _BadRequest(name, f"{name} must be a non-negative integer")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _BadRequest("stream", "stream must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _BadRequest("stream_options", "stream_options is only allowed with stream")
        if not isinstance(options, dict):
            raise _BadRequest("stream_options", "stream_options must be an object")
        for key, value in options.items():
            if key != "include_usage":
                raise _BadRequest(f"stream_options.{key}", f"unknown stream option {key}")
            if not isinstance(value, bool):
                raise _BadRequest(
                    "stream_options.include_usage", "include_usage must be true or false"
                )
            include_usage = value
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise _BadRequest("priority", "priority must be an integer")
    if priority != 0 and not priority_scheduling:
        # vLLM's words, as its OpenAI server refuses it under --scheduling-policy fcfs.
        raise _BadRequest(
            "priority", f"Got priority {priority} but Priority scheduling is not enabled."
        )
    limit = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    tokens = min(int(directives.get("tokens") or output_tokens), limit)
    return _Ask(limit, tokens, bool(stream), include_usage, priority)


class Simulator:
    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.stats = SimulatorStats()
        self._random = random.Random(config.seed)
        self._seen: Counter[str] = Counter()
        batching = config.batching()
        self._engine = EngineLoop(BatchingModel(batching)) if batching is not None else None
        self._slots = (
            asyncio.Semaphore(config.max_concurrency) if config.max_concurrency > 0 else None
        )
        # What /metrics reports when requests are timed alone (no batching model).
        self._queued = 0
        self._alone = EngineSnapshot()

    @property
    def model(self) -> BatchingModel | None:
        """The continuous-batching model, when ``slots > 0``."""
        return self._engine.model if self._engine is not None else None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.config.model_name, "object": "model"}]}
        )

    async def _stats(self, _: web.Request) -> web.Response:
        s = self.stats
        model = self.model
        return web.json_response(
            {
                "requests": s.requests,
                "in_flight": s.in_flight,
                "peak_in_flight": s.peak_in_flight,
                "by_status": {str(k): v for k, v in s.by_status.items()},
                "models": dict(s.models),
                "running": model.running if model else s.in_flight,
                "waiting": model.waiting if model else self._queued,
                "peak_running": model.peak_running if model else s.peak_in_flight,
            }
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.model is not None:
            snapshot = self.model.snapshot()
        else:
            snapshot = self._alone
            snapshot.running = self.stats.in_flight
            snapshot.waiting = self._queued
        return web.Response(
            body=render(snapshot, self.config.model_name).encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
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
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object")
        text = _prompt_text(body)
        directives = {m.group(1): m.group(2) for m in _DIRECTIVE.finditer(text)}
        try:
            ask = _ask(
                body,
                directives,
                self.config.output_tokens,
                priority_scheduling=self.config.scheduling_policy == "priority",
            )
        except _BadRequest as bad:
            return self._error(400, bad.message, param=bad.param)
        self.stats.models[str(body.get("model"))] += 1
        fault = self._fault(request, text, directives)
        if fault is not None:
            response: web.StreamResponse = await fault
            return response
        if self._engine is not None:
            return await self._batched(request, body, text, directives, chat, ask)
        if self._slots is None:
            return await self._answer(request, body, text, directives, chat, ask)
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        try:
            return await self._answer(request, body, text, directives, chat, ask)
        finally:
            self._slots.release()

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

    def _error(
        self,
        status: int,
        message: str,
        retry_after: str | None = None,
        param: str | None = None,
    ) -> web.Response:
        self.stats.by_status[status] += 1
        headers = {"Retry-After": retry_after} if retry_after else None
        error: dict[str, Any] = {"message": message, "type": "simulated", "code": status}
        if param is not None:
            error = {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_request_error",
            }
        return web.json_response({"error": error}, status=status, headers=headers)

    # ---- each request timed alone ----------------------------------------------------------

    async def _answer(
        self,
        request: web.Request,
        body: dict[str, Any],
        text: str,
        directives: dict[str, str | None],
        chat: bool,
        ask: _Ask,
    ) -> web.StreamResponse:
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        prompt_tokens = max(1, len(text.split()))
        c = self.config
        first_s = (c.ttft_ms + float(directives.get("delay_ms") or 0)) / 1000
        try:
            if ask.stream:
                # The last token comes when the whole answer would: one itl_ms per token.
                chunks = self._chunks(body, chat, ask)
                response = web.StreamResponse(headers=sim_replies.SSE_HEADERS)
                await response.prepare(request)
                await asyncio.sleep(first_s)
                if c.itl_ms > 0:
                    for index in range(ask.tokens):
                        await asyncio.sleep(c.itl_ms / 1000)
                        last = index == ask.tokens - 1
                        await response.write(
                            chunks.tokens(index, 1, ask.finish_reason if last else None)
                        )
                if c.itl_ms <= 0 or ask.tokens == 0:
                    await response.write(chunks.tokens(0, ask.tokens, ask.finish_reason))
                self._count_alone(prompt_tokens, ask)
                return await self._close_stream(response, chunks, ask, prompt_tokens, None)
            await asyncio.sleep(first_s + c.itl_ms * ask.tokens / 1000)
        finally:
            stats.in_flight -= 1
        self._count_alone(prompt_tokens, ask)
        return self._whole(body, chat, ask, sim_replies.usage(prompt_tokens, ask.tokens, None))

    def _count_alone(self, prompt_tokens: int, ask: _Ask) -> None:
        alone = self._alone
        alone.prompt_tokens += prompt_tokens
        alone.generation_tokens += ask.tokens
        alone.finished[ask.finish_reason] = alone.finished.get(ask.finish_reason, 0) + 1

    # ---- continuous batching ---------------------------------------------------------------

    async def _batched(
        self,
        request: web.Request,
        body: dict[str, Any],
        text: str,
        directives: dict[str, str | None],
        chat: bool,
        ask: _Ask,
    ) -> web.StreamResponse:
        assert self._engine is not None
        model = self._engine.model
        words = text.split()
        seq = Sequence(
            prompt_tokens=max(1, len(words)),
            max_tokens=ask.tokens,
            arrived_at=asyncio.get_running_loop().time(),
            block_hashes=block_hashes(words, model.config.block_tokens)
            if model.cache is not None
            else (),
            extra_prefill_s=float(directives.get("delay_ms") or 0) / 1000,
            finish_reason=ask.finish_reason,
            priority=ask.priority,
        )
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        ticket = self._engine.submit(seq, stream=ask.stream)
        try:
            if ask.stream:
                return await self._stream_batched(request, body, chat, ask, ticket)
            await ticket.done
        finally:
            stats.in_flight -= 1
            # A no-op once the answer is complete; otherwise the client left and the slot frees.
            self._engine.abort(ticket)
        cached = seq.cached_tokens if model.cache is not None else None
        return self._whole(
            body, chat, ask, sim_replies.usage(seq.prompt_tokens, ask.tokens, cached)
        )

    async def _stream_batched(
        self, request: web.Request, body: dict[str, Any], chat: bool, ask: _Ask, ticket: Ticket
    ) -> web.StreamResponse:
        assert self._engine is not None
        assert ticket.progress is not None
        model = self._engine.model
        seq = ticket.seq
        chunks = self._chunks(body, chat, ask)
        response = web.StreamResponse(headers=sim_replies.SSE_HEADERS)
        await response.prepare(request)
        sent = 0
        while True:
            await ticket.progress.wait()
            ticket.progress.clear()
            out = model.generated(seq)
            done = seq.phase is Phase.DONE
            if out > sent or done:
                finish = ask.finish_reason if done else None
                await response.write(chunks.tokens(sent, out - sent, finish))
                sent = out
            if done:
                break
        cached = seq.cached_tokens if model.cache is not None else None
        return await self._close_stream(response, chunks, ask, seq.prompt_tokens, cached)

    # ---- answers ---------------------------------------------------------------------------

    def _chunks(self, body: dict[str, Any], chat: bool, ask: _Ask) -> sim_replies.ChunkWriter:
        return sim_replies.ChunkWriter(
            chat=chat,
            number=self.stats.requests,
            created=int(time.time()),
            model=body.get("model"),
            include_usage=ask.include_usage,
        )

    async def _close_stream(
        self,
        response: web.StreamResponse,
        chunks: sim_replies.ChunkWriter,
        ask: _Ask,
        prompt_tokens: int,
        cached_tokens: int | None,
    ) -> web.StreamResponse:
        if ask.include_usage:
            await response.write(
                chunks.usage(sim_replies.usage(prompt_tokens, ask.tokens, cached_tokens))
            )
        await response.write(sim_replies.DONE_EVENT)
        await response.write_eof()
        self.stats.by_status[200] += 1
        return response

    def _whole(
        self, body: dict[str, Any], chat: bool, ask: _Ask, usage: dict[str, Any]
    ) -> web.Response:
        payload = sim_replies.completion(
            chat=chat,
            number=self.stats.requests,
            created=int(time.time()),
            model=body.get("model"),
            tokens=ask.tokens,
            finish_reason=ask.finish_reason,
            usage=usage,
        )
        self.stats.by_status[200] += 1
        return web.Response(body=orjson.dumps(payload), content_type="application/json")


def run_simulator(config: SimulatorConfig, host: str, port: int) -> None:
    # Handlers are cancelled when their client leaves, so a batched request gives its slot
    # back at once, as vLLM aborts a request whose connection closed.
    web.run_app(
        Simulator(config).app(),
        host=host,
        port=port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )
