"""Spans of the code under test, kept in memory. OpenTelemetry takes one tracer provider per
process, so the first test that collects installs it for the rest of the run; it samples only
while a test collects, so the other tests record nothing."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes


class _WhileCollecting(Sampler):
    """The caller's decision, or every trace, while ``collecting``; nothing otherwise."""

    def __init__(self) -> None:
        self.collecting = False
        self._inner = ParentBased(ALWAYS_ON)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if not self.collecting:
            return SamplingResult(Decision.DROP)
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return "WhileCollecting"


@functools.cache
def _installed() -> tuple[InMemorySpanExporter, _WhileCollecting]:
    exporter = InMemorySpanExporter()
    sampler = _WhileCollecting()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another tracer provider was installed"
    return exporter, sampler


@contextmanager
def collected_spans() -> Iterator[InMemorySpanExporter]:
    """The spans ended until the block ends (``get_finished_spans()``)."""
    exporter, sampler = _installed()
    exporter.clear()
    sampler.collecting = True
    try:
        yield exporter
    finally:
        sampler.collecting = False
        exporter.clear()


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]
