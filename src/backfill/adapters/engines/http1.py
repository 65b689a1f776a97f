"""A lean HTTP/1.1 client for the one call a worker makes per request: POST a JSON body to an
engine, read the whole answer.

aiohttp's client spends about three times the CPU of this one per request (cookies, tracing
hooks, header multidicts, its payload and writer layers), and on a machine whose cores the
engine shares, that CPU is taken from the model (docs/performance.md). What an engine's answer
needs is small: a status, a body (sized or chunked, which httptools' C parser handles), and
``Retry-After``. Connections are kept alive and reused, most recent first; one that sat idle
longer than servers usually keep it (uvicorn: 5 s) is closed rather than risked.

Health checks and everything else keep aiohttp (``openai_http.py``).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

# An idle connection older than this is closed, not reused: a server may have closed it just
# as a request goes out (uvicorn closes idle connections after 5 s), and a request lost that
# way would count as an engine failure.
IDLE_REUSE_S = 4.0


class ConnectionClosed(ConnectionError):
    """The connection ended, or sent what is not HTTP/1.1, before the whole answer."""


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes
    retry_after: str | None


class _Exchange(asyncio.Protocol):
    """One connection to the engine, one request on it at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.WriteTransport | None = None
        self._answer: asyncio.Future[Answer] | None = None
        self._body: list[bytes] = []
        self._retry_after: str | None = None
        self._head_done = False  # the answer's status line and headers are in
        self._sized = False  # Content-Length or chunked: the answer's end is in the stream
        self.open = True
        self.idle_since = 0.0

    # -- the request -------------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[Answer]:
        assert self._transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._answer

    @property
    def reusable(self) -> bool:
        return self.open and self._transport is not None and not self._transport.is_closing()

    def abort(self) -> None:
        self.open = False
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.WriteTransport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(f"the engine's answer is not HTTP/1.1 ({exc})")
            self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        answer = self._answer
        if answer is None or answer.done():
            return
        if exc is None and self._head_done and not self._sized:
            # Neither sized nor chunked: the body ends where the connection does.
            self.on_message_complete()
        else:
            self._fail("the engine closed the connection before its answer ended")

    # -- httptools' callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key == b"retry-after":
            self._retry_after = value.decode("latin-1")
        elif key == b"content-length" or (
            key == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._sized = True

    def on_headers_complete(self) -> None:
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        retry_after, self._retry_after = self._retry_after, None
        self._head_done = self._sized = False
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the final one follows
        answer, self._answer = self._answer, None
        if not self._parser.should_keep_alive():
            self.open = False
        if answer is not None and not answer.done():
            answer.set_result(Answer(status, body, retry_after))

    def _fail(self, why: str) -> None:
        self.open = False
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(ConnectionClosed(why))


class Http1Pool:
    """Keep-alive connections to one server; ``post`` sends a body and reads the answer.

    ``root``: the server's URL and path prefix (``http://host:8000``, ``https://host/engine``);
    ``tls``: whom an https server must prove it is (default: the system's trust store).
    Errors: ``TimeoutError`` past ``total_s`` (or ``connect_s`` to connect), ``OSError``
    (``ConnectionClosed``, refused, TLS) when no whole answer came back.
    """

    def __init__(
        self,
        root: str,
        headers: dict[str, str],
        *,
        connect_s: float,
        total_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(root)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {root!r}")
        self._host = parts.hostname
        secure = parts.scheme == "https"
        self._port = parts.port or (443 if secure else 80)
        # By default the system's trust store (SSL_CERT_FILE and SSL_CERT_DIR included), as
        # aiohttp's.
        self._ssl = (tls or ssl.create_default_context()) if secure else None
        self._prefix = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if secure else 80)
        lines = {"Host": host if default_port else f"{host}:{self._port}"}
        if parts.username is not None and "Authorization" not in headers:
            user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            lines["Authorization"] = "Basic " + base64.b64encode(user_pass.encode()).decode()
        # No compressed answers: decoding them would cost more CPU than the bytes saved.
        lines |= {"Accept-Encoding": "identity", "User-Agent": "backfill", **headers}
        if any("\r" in f"{k}{v}" or "\n" in f"{k}{v}" for k, v in lines.items()):
            raise ValueError("a header (the api_key?) holds a line break")
        self._head = "".join(f"{k}: {v}\r\n" for k, v in lines.items()).encode("latin-1")
        self._connect_s = connect_s
        self._total_s = total_s
        self._idle: list[_Exchange] = []

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> Answer:
        """``headers``: sent with this request only, after the pool's (trace context)."""
        extra = b""
        if headers:
            if any("\r" in f"{k}{v}" or "\n" in f"{k}{v}" for k, v in headers.items()):
                raise ValueError("a request header holds a line break")
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        request = b"".join(
            (
                f"POST {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"),
                self._head,
                extra,
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        async with asyncio.timeout(self._total_s):
            conn = await self._connection()
            try:
                answer = await conn.send(request)
            except BaseException:
                conn.abort()  # a half-read answer must not be read as the next one's
                raise
        if conn.open:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        return answer

    async def _connection(self) -> _Exchange:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable and now - conn.idle_since < IDLE_REUSE_S:
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_s):
            _, conn = await loop.create_connection(
                _Exchange,
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._host if self._ssl else None,
            )
        return conn

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
