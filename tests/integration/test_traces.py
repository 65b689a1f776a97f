"""Traces and JSON logs of a whole batch, in process: server spans for API requests (the
caller's trace continued), the worker's claim, engine request and finalize spans, trace
context sent to the engine, and no content in any span."""

from __future__ import annotations

import io
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from backfill.adapters.logs import JsonLines
from backfill.simulator.server import Simulator
from bench.common import free_port
from tests.receivers import webhook_receiver
from tests.support import (
    FAST,
    InProcess,
    Sim,
    backfill_with,
    chat_line,
    in_process_backfill,
    jsonl,
)
from tests.support.lines import SIM_MODEL
from tests.support.tracing import collected_spans, named
from tests.support.waits import eventually

# Tracing on for the app; the spans go to the tests' in-memory provider, not to this URL.
TRACING = {"otlp_endpoint": "http://collector.test:4318/v1/traces"}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
# Version 00, trace id, parent span id, flags with the sampled bit set (others may be too).
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f][13579bdf])$")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with collected_spans() as exporter:
        yield exporter


@asynccontextmanager
async def traced(tmp_path: Path, sim: Sim) -> AsyncIterator[InProcess]:
    async with backfill_with(tmp_path, sim, tracing=TRACING) as running:
        yield running


@asynccontextmanager
async def header_seeing_simulator() -> AsyncIterator[tuple[str, list[str | None]]]:
    """The simulator in this loop, noting the ``traceparent`` of every POST it is sent."""
    seen: list[str | None] = []

    @web.middleware
    async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST":
            seen.append(request.headers.get("traceparent"))
        return await handler(request)

    app = Simulator(replace(FAST)).app()
    app.middlewares.append(note)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        await runner.cleanup()


def server_span(spans: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = [s for s in named(spans.get_finished_spans(), name) if s.kind == SpanKind.SERVER]
    assert len(found) == 1, [s.name for s in spans.get_finished_spans()]
    return found[0]


def attribute_texts(span: ReadableSpan) -> list[str]:
    """Every attribute value of the span and its events, as text."""
    texts: list[str] = [span.name, span.status.description or ""]
    groups = [span.attributes or {}, *(event.attributes or {} for event in span.events)]
    for attributes in groups:
        for value in attributes.values():
            texts += [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
    return texts


async def test_an_upload_and_a_batch_creation_are_each_a_server_span_named_by_route(
    tmp_path: Path, sim: Sim, spans: InMemorySpanExporter
) -> None:
    async with traced(tmp_path, sim) as bf:
        batch = await bf.submit([chat_line("a")])
        await bf.batch(batch["id"])

    upload = server_span(spans, "POST /v1/files")
    creation = server_span(spans, "POST /v1/batches")
    reading = server_span(spans, "GET /v1/batches/{batch_id}")
    for span in (upload, creation, reading):
        assert span.parent is None
        assert span.attributes is not None
        assert span.attributes["http.response.status_code"] == 200
        assert str(span.attributes["backfill.request_id"]).startswith("req_")
    assert upload.attributes is not None
    assert upload.attributes["http.route"] == "/v1/files"
    assert upload.context is not None
    assert creation.context is not None
    assert upload.context.trace_id != creation.context.trace_id
    # Named by the template: the batch id is in no span name.
    assert not any(batch["id"] in s.name for s in spans.get_finished_spans())


async def test_a_callers_traceparent_makes_the_server_span_its_child(
    tmp_path: Path, sim: Sim, spans: InMemorySpanExporter
) -> None:
    async with traced(tmp_path, sim) as bf:
        response = await bf.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("input.jsonl", jsonl([chat_line("a")]), "application/jsonl")},
            headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
        )
        assert response.status_code == 200, response.text

    upload = server_span(spans, "POST /v1/files")
    assert upload.context is not None
    assert upload.parent is not None
    assert format_trace_id(upload.context.trace_id) == CALLER_TRACE
    assert format_span_id(upload.parent.span_id) == CALLER_SPAN
    assert upload.parent.is_remote


async def test_each_engine_request_sends_its_span_as_traceparent_and_no_span_holds_content(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    prompt = f"prompt-{uuid.uuid4().hex}"
    custom_id = f"custom-{uuid.uuid4().hex}"
    async with (
        header_seeing_simulator() as (url, seen),
        in_process_backfill(tmp_path, url, tracing=TRACING) as bf,
    ):
        batch = await bf.run_batch([chat_line(custom_id, prompt), chat_line("second", prompt)])
        assert batch["status"] == "completed", batch
        rows = await bf.rows(batch["output_file_id"])
        answers = [str(r["response"]["body"]["choices"][0]["message"]["content"]) for r in rows]

        async def finalized() -> list[ReadableSpan]:
            return named(spans.get_finished_spans(), "batch.finalize")

        # The batch reads as completed once published, a moment before the span ends.
        await eventually(finalized, what="the finalize span")
        key = bf.key

    finished = spans.get_finished_spans()
    requests = named(finished, "engine.request")
    assert len(requests) == 2
    sent = {(m.group(1), m.group(2)) for m in (TRACEPARENT.match(h or "") for h in seen) if m}
    assert len(seen) == 2, seen
    assert len(sent) == 2, seen
    assert sent == {
        (format_trace_id(s.context.trace_id), format_span_id(s.context.span_id))
        for s in requests
        if s.context is not None
    }
    for span in requests:
        assert span.kind == SpanKind.CLIENT
        assert span.attributes is not None
        assert span.attributes["backfill.model"] == SIM_MODEL
        assert span.attributes["backfill.engine"] == "sim"
        assert span.attributes["backfill.batch_id"] == batch["id"]
        assert span.attributes["backfill.attempt"] == 1
        assert span.attributes["http.response.status_code"] == 200

    claims = named(finished, "worker.claim")
    assert claims
    leased = [c.attributes.get("backfill.lines") for c in claims if c.attributes]
    assert leased in ([2], [1, 1])
    (finalize,) = named(finished, "batch.finalize")
    assert finalize.attributes is not None
    assert finalize.attributes["backfill.batch_id"] == batch["id"]
    assert finalize.attributes["backfill.published"] is True

    secrets = [prompt, custom_id, key, *(a for a in answers if len(a) > 3)]
    for span in finished:
        for text in attribute_texts(span):
            assert not any(secret in text for secret in secrets), (span.name, text)


async def test_a_json_log_line_names_the_request_and_the_trace_it_was_written_in(
    tmp_path: Path, sim: Sim, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(JsonLines())
    api_log = logging.getLogger("backfill.api")
    api_log.addHandler(handler)
    try:
        async with traced(tmp_path, sim) as bf:

            async def broken(*_: Any) -> None:
                raise RuntimeError("the store fell over")

            monkeypatch.setattr(bf.backfill.services.files, "get", broken)
            response = await bf.client.get(
                "/v1/files/file-abc",
                headers={
                    "x-request-id": "req-from-the-caller",
                    "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
                },
            )
            assert response.status_code == 500
    finally:
        api_log.removeHandler(handler)

    lines = [orjson.loads(line) for line in written.getvalue().splitlines()]
    (entry,) = [e for e in lines if e["message"] == "unexpected error"]
    assert entry["level"] == "ERROR"
    assert entry["logger"] == "backfill.api"
    assert entry["request_id"] == "req-from-the-caller"
    assert entry["trace_id"] == CALLER_TRACE
    assert "RuntimeError" in entry["exception"]
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", entry["time"])
    span = server_span(spans, "GET /v1/files/{file_id}")
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 500


async def test_a_webhook_delivery_is_a_span_without_the_receivers_address(
    tmp_path: Path, sim: Sim, spans: InMemorySpanExporter
) -> None:
    webhooks = {
        "webhook_allow_http": True,
        "webhook_allow_private": True,
        "notify_interval_s": 0.02,
    }
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, tracing=TRACING, **webhooks) as bf:
            uploaded = await bf.upload(jsonl([chat_line("a")]))
            url = f"{receiver.url}?token=receiver-secret"
            created = await bf.create(uploaded.json()["id"], webhook_url=url)
            assert created.status_code == 200, created.text
            batch = await bf.wait(created.json()["id"])

            async def delivered() -> list[ReadableSpan]:
                return named(spans.get_finished_spans(), "notification.deliver")

            (span,) = await eventually(delivered, what="the delivery span")
    assert span.attributes is not None
    assert span.attributes["backfill.batch_id"] == batch["id"]
    assert span.attributes["backfill.channel"] == "webhook"
    assert span.attributes["backfill.attempt"] == 1
    assert span.attributes["backfill.outcome"] == "delivered"
    assert span.attributes["http.response.status_code"] == 200
    assert not any("receiver-secret" in text for text in attribute_texts(span))
