"""OpenAI error envelopes, ``x-request-id`` and ``x-should-retry`` on every response."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.adapters.logs import current_request_id
from backfill.domain import ids
from backfill.errors import BackfillError

log = logging.getLogger("backfill.api")


def envelope(
    message: str,
    *,
    type_: str,
    code: str | None,
    param: str | None = None,
    line: int | None = None,
) -> bytes:
    """The JSON body of an OpenAI error answer."""
    error: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    if line is not None:
        error["line"] = line
    return orjson.dumps({"error": error})


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | None,
    param: str | None = None,
    line: int | None = None,
    retryable: bool = False,
    headers: dict[str, str] | None = None,
) -> Response:
    all_headers = {"x-should-retry": "true" if retryable else "false"}
    all_headers.update(headers or {})
    return Response(
        envelope(message, type_=type_, code=code, param=param, line=line),
        status_code=status,
        media_type="application/json",
        headers=all_headers,
    )


def backfill_error_response(exc: BackfillError, headers: dict[str, str] | None = None) -> Response:
    """The envelope of a BackfillError, with ``Retry-After`` when the error knows how long
    waiting takes (docs/api.md, "When to retry")."""
    all_headers = dict(headers or {})
    if exc.retry_after_s is not None:
        all_headers["Retry-After"] = str(exc.retry_after_s)
    return error_response(
        exc.status,
        exc.message,
        type_=exc.type,
        code=exc.code,
        param=exc.param,
        line=exc.line,
        retryable=exc.retryable,
        headers=all_headers,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BackfillError)
    async def _backfill(_: Request, exc: BackfillError) -> Response:
        if exc.status >= 500:
            log.error("request failed: %s", exc.code)
        return backfill_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_response(
            400,
            f"Invalid request: {first.get('msg', 'bad input')}"
            + (f" (field '{param}')" if param else "")
            + ".",
            type_="invalid_request_error",
            code="invalid_value",
            param=param,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        messages = {
            404: "Unknown URL; see /openapi.json for the API.",
            405: "Method not allowed on this URL.",
        }
        return error_response(
            exc.status_code,
            messages.get(exc.status_code, str(exc.detail)),
            type_="invalid_request_error",
            code="not_found" if exc.status_code == 404 else "method_not_allowed",
            retryable=exc.status_code >= 500,
        )


class RequestIdMiddleware:
    """Adds ``x-request-id`` (the client's, if it sent one) to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id" and 0 < len(value) <= 128:
                request_id = value
                break
        if request_id is None:
            request_id = ids.request_id().encode()

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", request_id))
                message["headers"] = headers
            await send(message)

        # Every log line written while the request is served names it (JSON logs).
        token = current_request_id.set(request_id.decode("latin-1"))
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Unexpected errors end here (inside Starlette's own 500 handler, so the answer
            # still carries the request id); nothing can be sent once a response has started.
            log.exception("unexpected error")
            if not started:
                response = error_response(
                    500,
                    "The server hit an unexpected error; retry, and report it if it persists.",
                    type_="server_error",
                    code="server_error",
                    retryable=True,
                )
                await response(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)
