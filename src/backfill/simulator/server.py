"""A simulated OpenAI-compatible engine for load and fault tests. It runs no model.

Two timing models (``docs/simulator.md`` has the formulas and every option):

- by default each request is timed alone: ``ttft_ms + itl_ms * output tokens``, optionally
  capped at ``max_concurrency`` requests at a time;
- with ``slots > 0``, continuous batching as vLLM V1 schedules it (``model``): a waiting
  queue, KV-cache blocks and preemption when they run out, chunked prefill in a token budget,
  one step loop whose steps get longer with every sequence and prefill token in them, an
  optional prefix cache, and optionally vLLM's priority policy (a request's ``priority``
  orders the waiting queue; under fcfs it is accepted and ignored).

Prompt tokens are the whitespace-separated words of the prompt text, plus a few per image or
audio clip (``prompt``, ``media``). Both models stream chat and completions
(``"stream": true``) and publish vLLM's metric names on ``/metrics``. Besides chat and
completions it serves ``/v1/responses`` (``responses``) and ``/v1/embeddings``
(``embeddings``, prefill-only requests) through the same timing model.

Faults come at random rates, or on demand from a directive in the prompt text, which makes
tests deterministic: ``[[sim:status=400]]``, ``[[sim:status=503]]``, ``[[sim:drop]]``,
``[[sim:hang]]``, ``[[sim:delay_ms=2000]]``, ``[[sim:tokens=5]]``, ``[[sim:fail_first=2]]``
(fail with 503 the first two times this prompt is seen). A ``response_format`` is honoured
(``structured``), unless ``[[sim:off_schema]]`` or ``[[sim:not_json]]`` says otherwise.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

from backfill.simulator import embeddings, fields, replies, responses, structured
from backfill.simulator import prompt as prompts
from backfill.simulator.engine import EngineLoop, Ticket
from backfill.simulator.fields import BadRequest
from backfill.simulator.metrics import EngineSnapshot, render
from backfill.simulator.model import (
    STEP_PROFILES,
    BatchingConfig,
    BatchingModel,
    Phase,
    Sequence,
    StepProfileName,
)
from backfill.simulator.prefix_cache import block_hashes
from backfill.simulator.prompt import Prompt

_DIRECTIVE = re.compile(r"\[\[sim:([a-z_]+)(?:=([0-9]+))?\]\]")

_PRESET = math.nan
"""The default of the four timing fields: the step profile's value, or the built-in one."""
_DEFAULT_TIMING = {"ttft_ms": 50.0, "itl_ms": 1.0, "itl_growth": 0.0, "prefill_ms_per_token": 0.0}


@dataclass
class SimulatorConfig:
    ttft_ms: float = _PRESET
    """Alone: time to first token. Batched: latency before the waiting queue (50 ms, or the
    step profile's)."""
    itl_ms: float = _PRESET
    """Alone: time per output token. Batched: a step's base time (1 ms, or the profile's)."""
    output_tokens: int = 64
    max_concurrency: int = 0
    error_rate: float = 0.0
    rate_limit_rate: float = 0.0
    drop_rate: float = 0.0
    seed: int | None = None
    slots: int = 0
    """0: each request timed alone (``max_concurrency`` may cap them); > 0: continuous
    batching with this many sequence slots."""
    prefill_ms_per_token: float = _PRESET
    """0, or the step profile's."""
    itl_growth: float = _PRESET
    """0, or the step profile's."""
    itl_knee: int = 0
    """Sequences a step holds at ``itl_ms`` before it grows (``BatchingConfig.itl_knee``)."""
    kv_capacity_tokens: int = 262_144
    block_tokens: int = 16
    prefix_cache_blocks: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's ``--scheduling-policy``: ``fcfs`` accepts and ignores a request's priority;
    ``priority`` (needs slots) orders the waiting queue by it, lower values first."""
    max_num_batched_tokens: int = 2048
    """vLLM's token budget of one engine step (needs slots when changed)."""
    step_profile: StepProfileName | None = None
    """Presets of ttft_ms, itl_ms, itl_growth and prefill_ms_per_token (``STEP_PROFILES``);
    a field given explicitly wins. Needs slots."""
    model_name: str = "simulated"
    embedding_dimensions: int = 64
    """Size of every ``/v1/embeddings`` vector; a request may ask for fewer."""

    def __post_init__(self) -> None:
        if self.step_profile is not None and self.step_profile not in STEP_PROFILES:
            raise ValueError(f"step_profile must be one of {', '.join(STEP_PROFILES)}")
        profile = STEP_PROFILES[self.step_profile] if self.step_profile is not None else None
        for name, default in _DEFAULT_TIMING.items():
            if math.isnan(getattr(self, name)):
                setattr(self, name, getattr(profile, name) if profile is not None else default)
        if self.slots < 0 or self.max_concurrency < 0:
            raise ValueError("slots and max_concurrency must not be negative")
        if self.embedding_dimensions < 1:
            raise ValueError("embedding_dimensions must be at least 1")
        if self.slots and self.max_concurrency:
            raise ValueError("slots replaces max_concurrency: set one of them, not both")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        batched_only = {
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "itl_growth": self.itl_growth,
            "itl_knee": self.itl_knee,
            "prefix_cache_blocks": self.prefix_cache_blocks,
            "scheduling_policy=priority": self.scheduling_policy == "priority",
            "max_num_batched_tokens": self.max_num_batched_tokens != 2048,
            "step_profile": self.step_profile is not None,
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
            itl_knee=self.itl_knee,
            kv_capacity_tokens=self.kv_capacity_tokens,
            block_tokens=self.block_tokens,
            prefix_cache_blocks=self.prefix_cache_blocks,
            priority_scheduling=self.scheduling_policy == "priority",
            max_num_batched_tokens=self.max_num_batched_tokens,
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


@dataclass(slots=True)
class _Job:
    """One generating request, as the timing models and the answer writers see it."""

    number: int
    body: dict[str, Any]
    prompt: Prompt
    directives: dict[str, str | None]
    ask: _Ask
    chat: bool
    """Chat or completion shapes, whole or streamed."""
    responses: responses.ResponsesAsk | None = None
    """Set for ``/v1/responses``: answered whole, as a Response object."""
    format: structured.Format | None = None
    """What ``response_format`` (or ``text.format``) asks the answer to be."""


def _directives(text: str) -> dict[str, str | None]:
    return {m.group(1): m.group(2) for m in _DIRECTIVE.finditer(text)}


def _ask(
    body: dict[str, Any],
    directives: dict[str, str | None],
    output_tokens: int,
) -> _Ask:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise BadRequest(name, f"{name} must be a non-negative integer")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", "stream must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options", "stream_options is only allowed with stream")
        if not isinstance(options, dict):
            raise BadRequest("stream_options", "stream_options must be an object")
        for key, value in options.items():
            if key != "include_usage":
                raise BadRequest(f"stream_options.{key}", f"unknown stream option {key}")
            if not isinstance(value, bool):
                raise BadRequest(
                    "stream_options.include_usage", "include_usage must be true or false"
                )
            include_usage = value
    priority = fields.priority(body)
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
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._embeddings)
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
        number = self.stats.requests
        try:
            body = await self._json(request)
            prompt = prompts.of_body(body)
            directives = _directives(prompt.text)
            ask = _ask(body, directives, self.config.output_tokens)
            fmt = structured.of_chat(body)
        except BadRequest as bad:
            return self._refuse(bad)
        self.stats.models[str(body.get("model"))] += 1
        job = _Job(number, body, prompt, directives, ask, chat, format=fmt)
        return await self._generate(request, job)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        number = self.stats.requests
        try:
            body = await self._json(request)
            asked = responses.parse(body)
        except BadRequest as bad:
            return self._refuse(bad)
        directives = _directives(asked.prompt.text)
        # No max_output_tokens: the simulator's own answer length, never cut short.
        limit = asked.max_output_tokens or sys.maxsize
        tokens = min(int(directives.get("tokens") or self.config.output_tokens), limit)
        ask = _Ask(limit, tokens, stream=False, include_usage=False, priority=asked.priority)
        self.stats.models[asked.model] += 1
        job = _Job(
            number,
            body,
            asked.prompt,
            directives,
            ask,
            chat=True,
            responses=asked,
            format=asked.format,
        )
        return await self._generate(request, job)

    async def _generate(self, request: web.Request, job: _Job) -> web.StreamResponse:
        fault = self._fault(request, job.prompt.text, job.directives)
        if fault is not None:
            response: web.StreamResponse = await fault
            return response
        if self._engine is not None:
            return await self._batched(request, job)
        if self._slots is None:
            return await self._answer(request, job)
        await self._wait_alone()
        try:
            return await self._answer(request, job)
        finally:
            self._slots.release()

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        size = self.config.embedding_dimensions
        try:
            body = await self._json(request)
            ask = embeddings.parse(body, size)
        except BadRequest as bad:
            return self._refuse(bad)
        self.stats.models[ask.model] += 1
        directives = _directives(ask.text)
        fault = self._fault(request, ask.text, directives)
        if fault is not None:
            response: web.StreamResponse = await fault
            return response
        delay_s = float(directives.get("delay_ms") or 0) / 1000
        if self._engine is not None:
            await self._prefill_batched(ask, delay_s)
        elif self._slots is None:
            await self._prefill_alone(ask, delay_s)
        else:
            await self._wait_alone()
            try:
                await self._prefill_alone(ask, delay_s)
            finally:
                self._slots.release()
        vectors = [embeddings.vector(key, size, ask.dimensions) for key in ask.keys]
        self.stats.by_status[200] += 1
        return web.Response(
            body=orjson.dumps(embeddings.reply(ask, vectors)), content_type="application/json"
        )

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise BadRequest(None, "request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest(None, "request body must be a JSON object")
        return body

    async def _wait_alone(self) -> None:
        """Take one of ``max_concurrency`` places; the caller releases it."""
        assert self._slots is not None
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1

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
        error = {"message": message, "type": "simulated", "code": status}
        return web.json_response({"error": error}, status=status, headers=headers)

    def _refuse(self, bad: BadRequest) -> web.Response:
        self.stats.by_status[400] += 1
        error = {
            "message": bad.message,
            "type": "invalid_request_error",
            "param": bad.param,
            "code": "invalid_request_error",
        }
        return web.json_response({"error": error}, status=400)

    # ---- each request timed alone ----------------------------------------------------------

    async def _answer(self, request: web.Request, job: _Job) -> web.StreamResponse:
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        ask = job.ask
        prompt_tokens = job.prompt.count
        c = self.config
        first_s = (c.ttft_ms + float(job.directives.get("delay_ms") or 0)) / 1000
        try:
            if ask.stream:
                # The last token comes when the whole answer would: one itl_ms per token.
                chunks = self._chunks(job)
                response = web.StreamResponse(headers=replies.SSE_HEADERS)
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
                self._count_alone(prompt_tokens, ask.tokens, ask.finish_reason)
                return await self._close_stream(response, chunks, ask, prompt_tokens, None)
            await asyncio.sleep(first_s + c.itl_ms * ask.tokens / 1000)
        finally:
            stats.in_flight -= 1
        self._count_alone(prompt_tokens, ask.tokens, ask.finish_reason)
        return self._whole(job, prompt_tokens, None)

    async def _prefill_alone(self, ask: embeddings.EmbeddingAsk, delay_s: float) -> None:
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            await asyncio.sleep(self.config.ttft_ms / 1000 + delay_s)
        finally:
            stats.in_flight -= 1
        for tokens in ask.inputs:
            self._count_alone(max(1, len(tokens)), 0, "stop")

    def _count_alone(self, prompt_tokens: int, output_tokens: int, finish_reason: str) -> None:
        alone = self._alone
        alone.prompt_tokens += prompt_tokens
        alone.generation_tokens += output_tokens
        alone.finished[finish_reason] = alone.finished.get(finish_reason, 0) + 1

    # ---- continuous batching ---------------------------------------------------------------

    def _sequence(
        self, tokens: list[str], output_tokens: int, delay_s: float, finish: str, priority: int
    ) -> Sequence:
        assert self._engine is not None
        model = self._engine.model
        return Sequence(
            prompt_tokens=max(1, len(tokens)),
            max_tokens=output_tokens,
            arrived_at=asyncio.get_running_loop().time(),
            block_hashes=block_hashes(tokens, model.config.block_tokens)
            if model.cache is not None
            else (),
            extra_prefill_s=delay_s,
            finish_reason=finish,
            priority=priority,
        )

    async def _batched(self, request: web.Request, job: _Job) -> web.StreamResponse:
        assert self._engine is not None
        model = self._engine.model
        ask = job.ask
        delay_s = float(job.directives.get("delay_ms") or 0) / 1000
        seq = self._sequence(
            job.prompt.tokens, ask.tokens, delay_s, ask.finish_reason, ask.priority
        )
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        ticket = self._engine.submit(seq, stream=ask.stream)
        try:
            if ask.stream:
                return await self._stream_batched(request, job, ticket)
            await ticket.done
        finally:
            stats.in_flight -= 1
            # A no-op once the answer is complete; otherwise the client left and the slot frees.
            self._engine.abort(ticket)
        if model.cache is None:
            return self._whole(job, seq.prompt_tokens, None)
        # The prompt's full blocks entered the cache at the end of its prefill.
        written = len(seq.block_hashes) * model.config.block_tokens - seq.cached_tokens
        return self._whole(job, seq.prompt_tokens, seq.cached_tokens, max(0, written))

    async def _prefill_batched(self, ask: embeddings.EmbeddingAsk, delay_s: float) -> None:
        """Each input is a sequence of its own that ends with its prefill, as vLLM splits an
        embedding request's inputs."""
        assert self._engine is not None
        engine = self._engine
        seqs = [self._sequence(t, 0, delay_s, "stop", ask.priority) for t in ask.inputs]
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        tickets = [engine.submit(seq, stream=False) for seq in seqs]
        try:
            await asyncio.gather(*(ticket.done for ticket in tickets))
        finally:
            stats.in_flight -= 1
            for ticket in tickets:
                engine.abort(ticket)

    async def _stream_batched(
        self, request: web.Request, job: _Job, ticket: Ticket
    ) -> web.StreamResponse:
        assert self._engine is not None
        assert ticket.progress is not None
        model = self._engine.model
        ask = job.ask
        seq = ticket.seq
        chunks = self._chunks(job)
        response = web.StreamResponse(headers=replies.SSE_HEADERS)
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

    def _chunks(self, job: _Job) -> replies.ChunkWriter:
        return replies.ChunkWriter(
            chat=job.chat,
            number=job.number,
            created=int(time.time()),
            model=job.body.get("model"),
            include_usage=job.ask.include_usage,
            received=job.prompt.received,
        )

    async def _close_stream(
        self,
        response: web.StreamResponse,
        chunks: replies.ChunkWriter,
        ask: _Ask,
        prompt_tokens: int,
        cached_tokens: int | None,
    ) -> web.StreamResponse:
        if ask.include_usage:
            await response.write(
                chunks.usage(replies.usage(prompt_tokens, ask.tokens, cached_tokens))
            )
        await response.write(replies.DONE_EVENT)
        await response.write_eof()
        self.stats.by_status[200] += 1
        return response

    def _whole(
        self, job: _Job, prompt_tokens: int, cached_tokens: int | None, written_tokens: int = 0
    ) -> web.Response:
        ask = job.ask
        created = int(time.time())
        cut_short = ask.finish_reason == "length"
        text = None
        if job.format is not None:
            text = structured.answer(job.format, ask.tokens, job.directives, cut_short)
        payload: dict[str, Any]
        if job.responses is not None:
            payload = responses.reply(
                job.responses,
                number=job.number,
                created=created,
                tokens=ask.tokens,
                cut_short=cut_short,
                cached_tokens=cached_tokens or 0,
                written_tokens=written_tokens,
                text=text,
            )
        else:
            payload = replies.completion(
                chat=job.chat,
                number=job.number,
                created=created,
                model=job.body.get("model"),
                tokens=ask.tokens,
                finish_reason=ask.finish_reason,
                usage=replies.usage(prompt_tokens, ask.tokens, cached_tokens),
                received=job.prompt.received,
                content=text,
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
