"""OpenTelemetry traces (docs/observability.md): the process's tracer provider, installed only
when ``[tracing] otlp_endpoint`` is set. Until then every span Backfill starts is
OpenTelemetry's no-op one: nothing is recorded, nothing is sent."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from backfill import __version__
from backfill.adapters.engines.openai_http import public_url
from backfill.settings import TracingSettings

log = logging.getLogger("backfill")

# An export that takes longer is dropped: spans must never hold a worker back.
EXPORT_TIMEOUT_S = 10.0


def tracer_provider(settings: TracingSettings, processor: SpanProcessor) -> TracerProvider:
    """A provider naming this service, keeping ``sample_ratio`` of the traces that start here
    and following the caller's decision for those it continues, its spans sent to
    ``processor``."""
    resource = Resource.create(
        {"service.name": settings.service_name, "service.version": __version__}
    )
    sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(processor)
    return provider


def install(settings: TracingSettings) -> TracerProvider | None:
    """Send this process's spans to the OTLP/HTTP collector the settings name; None (and
    nothing installed) when they name none. The provider flushes what it holds at exit."""
    if not settings.otlp_endpoint:
        return None
    exporter = OTLPSpanExporter(
        endpoint=settings.otlp_endpoint,
        headers=dict(settings.headers),
        timeout=EXPORT_TIMEOUT_S,
    )
    # Batched in a thread of the SDK's: exporting never runs on the event loop.
    provider = tracer_provider(settings, BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info(
        "sending traces to %s as service %s (sample ratio %g)",
        public_url(settings.otlp_endpoint),
        settings.service_name,
        settings.sample_ratio,
    )
    return provider
