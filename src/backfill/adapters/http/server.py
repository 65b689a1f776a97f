"""The HTTP server ``backfill up`` and ``backfill serve`` run: uvicorn's httptools protocol plus
the connection limits uvicorn lacks.

uvicorn bounds neither the size of a request head under httptools (only h11 has
``h11_max_incomplete_event_size``) nor the time a client may take to send its head, the gaps
in its body or a small body's total time; ``limit_concurrency`` answers 503 only once a head is
complete, so connections that never finish one are not counted against anything. Without these,
one client can make the process buffer a 50 MB header or hold thousands of half-open
connections and upload files.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, ClassVar, cast

import uvicorn
from starlette.types import ASGIApp
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from backfill.adapters.http.envelope import envelope
from backfill.adapters.http.guard import is_streamed_upload
from backfill.settings import Settings

log = logging.getLogger("backfill.api")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 30.0
    max_connections: int = 512

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        edge = settings.http
        return cls(
            max_header_bytes=edge.max_header_bytes,
            header_timeout_s=edge.header_timeout_s,
            body_idle_timeout_s=edge.body_idle_timeout_s,
            max_connections=edge.max_connections,
        )


def _refusal(status: int, message: str, code: str, *, retryable: bool = False) -> bytes:
    """A whole HTTP/1.1 answer with the OpenAI envelope, for refusals made below the app."""
    body = envelope(message, type_="invalid_request_error", code=code)
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"x-should-retry: {'true' if retryable else 'false'}\r\n"
        + ("retry-after: 1\r\n" if retryable else "")
        + "connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Date:
    """The ``Date`` header's value for the current second, made once per second that sees a
    request."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, formatdate(second, usegmt=True).encode()
        return cls.value


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection, with a head size cap, a head deadline, body idle and total-time limits
    and a cap on open connections. ``limits`` is set on the subclass ``guarded_protocol`` makes.

    The deadlines are kept by one watchdog timer per connection that looks at timestamps the
    parser callbacks leave, so a request costs a few attribute writes rather than arming and
    cancelling timers.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Raw bytes of reads that fell wholly between requests or inside an unfinished head:
        # bounds what the parser buffers for a head it has not finished (it hands a header
        # over only once the header ends, so the callbacks cannot count a header in progress).
        self._head_bytes = 0
        # No request in progress or its head unfinished (True); its body being read (False).
        self._reading_head = True
        # Ends of heads and of messages the parser has seen: tells whether a read crossed one.
        self._boundaries = 0
        # When the head being waited for became due (None: none is), the body's last progress,
        # and when a body that is not an upload must be complete.
        self._head_since: float | None = None
        self._body_since: float | None = None
        self._body_deadline: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._watched_at = self.loop.time()
        # A head refused inside the parser, answered once the parser returns.
        self._refused: bytes | None = None
        # Nothing more is read: the connection ends with the response being written.
        self._ending = False

    # ---- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio types the argument as any transport; a stream server hands its protocols a
        # stream transport, the one uvicorn's protocol takes.
        super().connection_made(cast(asyncio.Transport, transport))
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection: %d are open", len(self.connections) - 1)
            self._answer_and_close(
                _refusal(
                    503,
                    f"The server has {self.limits.max_connections} open connections "
                    "(max_connections); retry shortly.",
                    "server_busy",
                    retryable=True,
                )
            )
            return
        # A connection that sends nothing is held no longer than a slow head.
        self._head_since = self.loop.time()
        self._arm_watchdog()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._ending:
            return
        self._date_header()
        between = self._reading_head
        if between and self._head_since is None:
            # Bytes while no request is in progress end the keep-alive wait (uvicorn cancels
            # its timer), also when they begin no request (a bare CRLF, which the parser skips,
            # or bytes after an upgrade Backfill does not make): a head is now due in time.
            self._head_since = self.loop.time()
        boundaries = self._boundaries
        super().data_received(data)
        if self._refused is not None:
            self._refuse_next(self._refused)
        elif between and self._reading_head and boundaries == self._boundaries:
            # The whole read lies before a head's end. A read that completes a request and
            # starts the next head is not counted: that head's share of it is at most one read,
            # and a finished head is measured whole in on_headers_complete.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse_next(self._head_too_large())

    def _date_header(self) -> None:
        """Keep the ``Date`` of uvicorn's default headers current. uvicorn refreshes it from a
        timer once a second, which would wake an idle server every second (a wake-up is CPU
        taken from an engine on the same cores); here a read that may begin a response does
        it, and the server's loop has no timer (``backfill.cli.main``)."""
        if not self.config.date_header:
            return
        date = _Date.now()
        state = self.server_state
        headers = state.default_headers
        if not headers or headers[0][1] is not date:
            state.default_headers = [(b"date", date), *self.config.encoded_headers]

    # ---- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_since is None:
            self._head_since = self.loop.time()

    def on_headers_complete(self) -> None:
        self._boundaries += 1
        self._head_since = None
        self._reading_head = False
        self._head_bytes = 0
        # The parser may hand over a whole head from one read: measure it as parsed too.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            # Refused once the parser returns: the app never sees this request.
            self._refused = self._head_too_large()
            return
        super().on_headers_complete()
        now = self.loop.time()
        self._body_since = now
        if not is_streamed_upload(self.scope["method"], self.scope.get("path", "")):
            # A small body sent a byte just inside every idle timeout could hold the route
            # (and the connection) for days; every body but the upload's has a total time.
            self._body_deadline = now + self.limits.body_idle_timeout_s

    def on_body(self, body: bytes) -> None:
        if self._refused is not None:
            return
        super().on_body(body)
        self._body_since = self.loop.time()

    def on_message_complete(self) -> None:
        self._boundaries += 1
        if self._refused is not None:
            return
        super().on_message_complete()
        self._body_since = None
        self._body_deadline = None
        self._reading_head = True
        self._head_bytes = 0

    # ---- deadlines -------------------------------------------------------------------------

    def _arm_watchdog(self) -> None:
        # A quarter of the shorter timeout: a deadline is enforced at most 25% late.
        every = min(self.limits.header_timeout_s, self.limits.body_idle_timeout_s) / 4
        self._watchdog = self.loop.call_later(every, self._watch)

    def _watch(self) -> None:
        self._watchdog = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        limits = self.limits
        if self._head_since is not None and now - self._head_since > limits.header_timeout_s:
            if self._answering():
                # Still answering the previous request; the next head is not late yet.
                self._head_since = now
            else:
                self._answer_and_close(
                    _refusal(
                        408,
                        f"The request head did not arrive within {limits.header_timeout_s:g} s "
                        "(header_timeout_s).",
                        "request_timeout",
                    )
                )
                return
        # While reading is paused the app has not taken the bytes already here; the client is
        # not the one late.
        client_late = not self.flow.read_paused
        if self._body_since is not None and now - self._body_since > limits.body_idle_timeout_s:
            if client_late:
                # The route may be mid-upload: closing makes it see a disconnect and clean up.
                log.info(
                    "closed a connection whose request body stalled for %g s",
                    now - self._body_since,
                )
                self.transport.close()
                return
            self._body_since = now
        if self._body_deadline is not None:
            if not client_late:
                # Time spent waiting on the app (a pipelined request waits for the one before)
                # is not the client's: the deadline moves by it.
                self._body_deadline += now - self._watched_at
            elif now > self._body_deadline:
                self._body_too_slow()
                if self.transport.is_closing():
                    return
        self._watched_at = now
        self._arm_watchdog()

    def _answering(self) -> bool:
        """Whether a request's answer is still to be written or being written."""
        return self.cycle is not None and not self.cycle.response_complete

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        cycle = self.cycle
        log.info("cut a request body not complete within %g s", self.limits.body_idle_timeout_s)
        if cycle.response_started:
            # The route answered without the rest of the body: the connection ends with that
            # answer (on_body drops what still comes).
            cycle.keep_alive = False
            return
        # The route sees a disconnect, and whatever it might still send is dropped, so the
        # answer below is the only one on the wire.
        cycle.disconnected = True
        cycle.message_event.set()
        self._answer_and_close(
            _refusal(
                408,
                f"The request body did not arrive within {self.limits.body_idle_timeout_s:g} s "
                "(body_idle_timeout_s).",
                "request_timeout",
            )
        )

    # ---- refusals --------------------------------------------------------------------------

    def _head_too_large(self) -> bytes:
        return _refusal(
            431,
            f"The request line and headers are larger than {self.limits.max_header_bytes} "
            "bytes (max_header_bytes).",
            "request_header_too_large",
        )

    def _refuse_next(self, answer: bytes) -> None:
        """Refuse the head being read. While an earlier request is still being answered, the
        refusal would land inside (or ahead of) that answer: the connection ends after it
        instead, and nothing more is read."""
        if self._answering():
            self._ending = True
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        self._answer_and_close(answer)

    def _answer_and_close(self, answer: bytes) -> None:
        self._ending = True
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn, carrying ``limits`` (uvicorn builds it by class)."""
    return type("BackfillHttpProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def server_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # JSON logs: uvicorn's own lines go through the root logger's JSON formatter too.
        log_config=LOGGING_CONFIG if settings.log_format == "text" else None,
        access_log=False,
        timeout_graceful_shutdown=5,
        http=guarded_protocol(ConnectionLimits.from_settings(settings)),
        # Forwarded headers are believed only from the listed proxies; never from loopback by
        # default (uvicorn's own default, and its FORWARDED_ALLOW_IPS variable, are not used).
        proxy_headers=bool(settings.http.forwarded_allow_ips),
        forwarded_allow_ips=settings.http.forwarded_allow_ips,
        # Backfill has no WebSocket routes; an upgrade request is answered as plain HTTP.
        ws="none",
    )
