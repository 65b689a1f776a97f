"""The first look at every request, from its headers, before any byte of its body is read.

FastAPI reads and decodes a JSON body before it resolves a route's dependencies, so neither a
body limit nor the admin check can live in the routes: a client without credentials could make
the process hold hundreds of megabytes. This pure ASGI layer refuses from the headers alone
(admin API closed or token wrong, declared body too large, address braked for failed
admin or metrics authentications) and cuts a body that grows past the limit while it streams.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.adapters.http.auth import FailureBrake, admin_refusal
from backfill.adapters.http.envelope import backfill_error_response
from backfill.errors import BackfillError, PayloadTooLarge

log = logging.getLogger("backfill.api")

ADMIN_PREFIX = "/admin/v1"
# Routes whose secret a person chooses (admin_token, metrics_token): failed authentications
# there are counted, and a braked address gets 429 there. Org API keys are 256 random bits, so
# guessing them is hopeless, and braking /v1 would let anyone sharing an address (behind a proxy,
# a NAT) lock every tenant there out with a few bad requests.
BRAKED_PREFIXES = (ADMIN_PREFIX, "/metrics")
CLOSE = {"Connection": "close"}
CLOSE_RAW = [(b"connection", b"close")]


def is_streamed_upload(method: str, path: str) -> bool:
    """``POST /v1/files`` streams its body into storage under its own file-size limit."""
    return method == "POST" and path.rstrip("/") == "/v1/files"


def _declared_length(scope: Scope) -> tuple[int | None, bool]:
    """The Content-Length (None when absent or unreadable) and whether a body follows."""
    length: int | None = None
    chunked = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked or bool(length)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class EdgeGuard:
    """Admin authentication, JSON body limit and failed-authentication brake, as ASGI."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        admin_token: str | None,
        max_json_body_bytes: int,
        brake: FailureBrake | None,
    ) -> None:
        self.app = app
        self.admin_token = admin_token
        self.max_json_body_bytes = max_json_body_bytes
        self.brake = brake

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        client = _client(scope)
        length, has_body = _declared_length(scope)
        # A refusal sent before the body was read closes the connection: otherwise the server
        # would have to read (and throw away) the whole body to find the next request.
        close = CLOSE if has_body else None

        braked_route = path.startswith(BRAKED_PREFIXES)
        if self.brake is not None and braked_route:
            braked = self.brake.refusal(client)
            if braked is not None:
                await backfill_error_response(braked, close)(scope, receive, send)
                return
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            refusal = admin_refusal(scope["headers"], self.admin_token)
            if refusal is not None:
                self._count(braked_route, client, refusal.status)
                await backfill_error_response(refusal, close)(scope, receive, send)
                return

        limit = None if is_streamed_upload(scope["method"], path) else self.max_json_body_bytes
        if limit is not None and length is not None and length > limit:
            await backfill_error_response(self._too_large(limit), CLOSE)(scope, receive, send)
            return

        started = False
        answered = False
        received = 0
        body_read = not has_body

        async def limited_receive() -> Message:
            nonlocal received, answered, body_read
            message = await receive()
            if message["type"] != "http.request":
                return message
            if not message.get("more_body", False):
                body_read = True
            if limit is None:
                return message
            received += len(message.get("body", b""))
            if received <= limit:
                return message
            if not started and not answered:
                answered = True
                await backfill_error_response(self._too_large(limit), CLOSE)(scope, receive, send)
            # The route sees the client go away and stops; what it answers is dropped.
            return {"type": "http.disconnect"}

        async def watched_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
                self._count(braked_route, client, message["status"])
                if not body_read:
                    # The route answered without reading the whole body: the rest would have to
                    # be read (and thrown away) to find the next request, at whatever pace the
                    # client likes, so the connection ends with this answer.
                    message = {**message, "headers": [*message.get("headers", []), *CLOSE_RAW]}
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except ClientDisconnect:
            # The client went away (or its body was cut above): nobody is left to answer, and
            # the route has already cleaned up after itself.
            log.info("client disconnected before the request was read: %s", path)
        except Exception:
            if not answered:
                raise

    def _count(self, braked_route: bool, client: str, status: int) -> None:
        if braked_route and status == 401 and self.brake is not None:
            self.brake.record_failure(client)

    @staticmethod
    def _too_large(limit: int) -> BackfillError:
        return PayloadTooLarge(
            f"The request body is larger than {limit} bytes (max_json_body_bytes); "
            "upload input data with POST /v1/files.",
            code="request_too_large",
        )
