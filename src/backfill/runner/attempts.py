"""Sending one request to its engine until it has an outcome: retries with backoff for
transient failures, within the attempt limit and the batch's window (SPEC §9.2)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from backfill.domain.embeddings import requested
from backfill.domain.endpoints import EMBEDDINGS_URL
from backfill.domain.output_schema import expected
from backfill.domain.records import ClaimedItem, WorkBatch
from backfill.metrics import Metrics
from backfill.ports import Clock, EngineReply, EngineTimeout, EngineUnreachable
from backfill.runner.give_back import GivenBack
from backfill.runner.replies import Outcome, engine_error, failed, succeeded
from backfill.runner.retry import backoff_s, is_transient
from backfill.runner.slots import EngineSlot
from backfill.runner.spans import tracer

# Answers that say the engine has no room now: a shared engine takes fewer (SPEC §9.5).
_OVERLOADED = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    base_s: float
    max_s: float


class Attempts:
    def __init__(
        self, policy: RetryPolicy, clock: Clock, metrics: Metrics, rng: random.Random | None = None
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._metrics = metrics
        self._rng = rng or random.Random()

    async def run(
        self, slot: EngineSlot, batch: WorkBatch, item: ClaimedItem, body: dict[str, Any]
    ) -> Outcome | None:
        """The request's outcome; None when its engine went away, or the request was given
        back to people waiting for its slot (it goes back to the queue without an attempt
        counted)."""
        engine = slot.engine
        policy = self._policy
        embeddings = requested(body) if batch.endpoint == EMBEDDINGS_URL else None
        # Read only for a batch that asked for its answers to be checked: the others pay
        # nothing for the feature.
        asked = expected(batch.endpoint, body) if batch.output_validation else None
        attempt = 0
        while True:
            attempt += 1
            retry_after: float | None = None
            overloaded = 0
            started = self._clock.monotonic()
            reason = "timeout"
            try:
                reply = await self._send(slot, batch, item, attempt, body)
            except GivenBack:
                self._metrics.given_back.labels(engine.name).inc()
                self._metrics.given_back_seconds.labels(engine.name).inc(
                    self._clock.monotonic() - started
                )
                return None
            except EngineTimeout:
                final = failed(item.custom_id, "request_timeout")
            except EngineUnreachable:
                reason = "unreachable"
                if not await slot.check():
                    return None
                final = failed(item.custom_id, "engine_unavailable")
            else:
                took = self._clock.monotonic() - started
                self._metrics.latency.labels(engine.name).observe(took)
                reason = str(reply.status)
                if reply.status == 200:
                    outcome = succeeded(item.custom_id, reply.body, embeddings, asked)
                    slot.succeeded(took, outcome.output_tokens)
                    return outcome
                final = engine_error(item.custom_id, reply.status, reply.body)
                if not is_transient(reply.status):
                    return final
                retry_after = reply.retry_after_s
                if reply.status in _OVERLOADED:
                    overloaded = reply.status
            delay = backoff_s(attempt, policy.base_s, policy.max_s, retry_after, self._rng)
            if overloaded:
                # After the delay is known: the engine's report says when the next try is.
                slot.overloaded(retry_after, overloaded, delay)
            if attempt >= policy.max_attempts or self._clock.now() + delay >= batch.expires_at:
                return final
            self._metrics.retries.labels(engine.name, reason).inc()
            await asyncio.sleep(delay)

    async def _send(
        self,
        slot: EngineSlot,
        batch: WorkBatch,
        item: ClaimedItem,
        attempt: int,
        body: dict[str, Any],
    ) -> EngineReply:
        """One try at the engine, in an engine-request span whose context the engine is sent
        (``traceparent``) when tracing is on."""
        engine = slot.engine
        call = engine.send(batch.endpoint, batch.model, body)
        span = tracer.start_span("engine.request", kind=SpanKind.CLIENT)
        if not span.get_span_context().is_valid:
            return await slot.sends.run(call)
        recording = span.is_recording()
        if recording:
            span.set_attributes(
                {
                    "backfill.batch_id": batch.id,
                    "backfill.line": item.idx,
                    "backfill.model": batch.model,
                    "backfill.endpoint": batch.endpoint,
                    "backfill.engine": engine.name,
                    "backfill.attempt": attempt,
                }
            )
        # The exception's type only: a message may quote the engine's answer.
        with trace.use_span(
            span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        ):
            try:
                reply = await slot.sends.run(call)
            except GivenBack:
                # Not a failure: people took the slot back; the line runs again later.
                if recording:
                    span.set_attribute("backfill.given_back", True)
                raise
            except BaseException as exc:
                if recording:
                    span.set_status(StatusCode.ERROR, type(exc).__name__)
                raise
            if recording:
                span.set_attribute("http.response.status_code", reply.status)
                if reply.status != 200:
                    span.set_status(StatusCode.ERROR, f"HTTP {reply.status}")
            return reply
