"""A server span per API request (docs/observability.md), installed only when tracing is on."""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The only request headers read: W3C trace context, so the span continues the caller's trace.
_CONTEXT_HEADERS = frozenset({b"traceparent", b"tracestate"})


class ServerSpans:
    """Starts a span for each HTTP request, a child of the caller's ``traceparent`` when it
    sent one. It is named by the route's template ("POST /v1/batches/{batch_id}/cancel"), so
    spans of one route group together and no id lands in a name; the path itself is not kept."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tracer = trace.get_tracer("backfill.api")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in _CONTEXT_HEADERS
        }
        parent = propagate.extract(carrier) if carrier else None
        method: str = scope["method"]
        status = 0
        request_id: str | None = None

        async def send_seen(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        request_id = value.decode("latin-1")
            await send(message)

        with self._tracer.start_as_current_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.scheme": scope.get("scheme", "http")},
            # An exception's message may quote what the client sent; its type is enough.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                await self.app(scope, receive, send_seen)
            except BaseException as exc:
                span.set_status(StatusCode.ERROR, type(exc).__name__)
                raise
            finally:
                if span.is_recording():
                    route = _route_template(scope)
                    if route is not None:
                        span.update_name(f"{method} {route}")
                        span.set_attribute("http.route", route)
                    if status:
                        span.set_attribute("http.response.status_code", status)
                    if request_id is not None:
                        span.set_attribute("backfill.request_id", request_id)
            if status >= 500:
                span.set_status(StatusCode.ERROR)


def _route_template(scope: Scope) -> str | None:
    """The matched route's path template (FastAPI leaves the route in the scope); None for a
    URL no route matched."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None
