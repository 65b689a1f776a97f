"""The worker's spans (docs/observability.md), through OpenTelemetry's API. Until the process
installs a tracer provider (``[tracing] otlp_endpoint``) every span is the API's no-op one: the
hot paths make no span and only check that they got none.

Spans carry ids, names and counts only, never a prompt, an answer, a custom_id or a key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

tracer = trace.get_tracer("backfill.worker")


def span_since(
    name: str, start_ns: int, attributes: Callable[[], Mapping[str, AttributeValue]]
) -> None:
    """Record ``name`` as a span from ``start_ns`` (``time.time_ns()``) until now, its
    attributes made only when it is recorded: for work worth a span only once its result is
    known, such as a claim that found lines (an empty one, every poll, would be noise)."""
    span = tracer.start_span(name, start_time=start_ns)
    if span.is_recording():
        span.set_attributes(attributes())
    span.end()
