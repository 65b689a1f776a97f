"""Log lines as JSON objects (``log_format = "json"``), for log pipelines: time, level, logger,
message, and the API request and trace they were written in, when there is one."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson
from opentelemetry import trace

# The x-request-id of the API request being served, set by RequestIdMiddleware for the
# request's duration: it lets an operator find every line one request wrote.
current_request_id: ContextVar[str | None] = ContextVar("backfill_request_id", default=None)


class JsonLines(logging.Formatter):
    """One JSON object per record, on one line (a traceback is a field, not more lines)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (request_id := current_request_id.get()) is not None:
            entry["request_id"] = request_id
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = trace.format_trace_id(span.trace_id)
            entry["span_id"] = trace.format_span_id(span.span_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry).decode()
