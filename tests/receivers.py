"""Real receivers for notifications: an HTTP server that records webhooks and answers as a
test scripts it, and an SMTP server that keeps the messages it is sent. Both run on a thread of
their own, so in-process tests and tests of real server processes use them alike."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default
from typing import Any

import orjson
from aiohttp import web
from aiosmtpd.controller import Controller
from standardwebhooks.webhooks import Webhook

from tests.support import eventually, free_port


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    def verifies_with(self, secret: str) -> bool:
        try:
            Webhook(secret).verify(self.body, self.headers)
        except Exception:
            return False
        return True


@dataclass
class Answer:
    """What the receiver does with one request: wait ``delay_s``, then answer ``status``."""

    status: int = 200
    delay_s: float = 0.0


@dataclass
class WebhookReceiver:
    """Answers requests in the order of ``script`` (then 200s), recording each one."""

    port: int
    script: list[Answer] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        with self._lock:
            self.received.append(
                Received(
                    request.path,
                    {k.lower(): v for k, v in request.headers.items()},
                    body,
                    time.monotonic(),
                )
            )
            answer = self.script.pop(0) if self.script else Answer()
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        return web.Response(status=answer.status, text="ok")

    def wait_for(self, count: int, timeout_s: float = 30) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.received) >= count:
                    return list(self.received)
            time.sleep(0.02)
        raise AssertionError(f"{len(self.received)} webhooks arrived, not {count}")

    async def wait_for_async(self, count: int, timeout_s: float = 30) -> list[Received]:
        async def arrived() -> list[Received]:
            with self._lock:
                return list(self.received)

        return await eventually(
            arrived, lambda got: len(got) >= count, timeout_s, what=f"{count} webhooks"
        )


@contextmanager
def webhook_receiver(
    script: list[Answer] | None = None, port: int | None = None
) -> Iterator[WebhookReceiver]:
    """A receiver listening on 127.0.0.1 (on ``port`` when given) until the block ends."""
    receiver = WebhookReceiver(port or free_port(), list(script or []))
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner: web.AppRunner | None = None

    async def serve() -> None:
        nonlocal runner
        app = web.Application()
        app.router.add_post("/{tail:.*}", receiver.handle)
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", receiver.port).start()
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    ready.wait(10)
    try:
        yield receiver
    finally:
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
        self.envelopes: list[tuple[str, list[str]]] = []
        # Every RCPT TO the server accepted, whether or not its message then arrived.
        self.rcpts: list[str] = []

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: list[str]
    ) -> str:
        self.rcpts.append(address)
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        parsed = BytesParser(policy=default).parsebytes(envelope.original_content)
        assert isinstance(parsed, EmailMessage)
        self.messages.append(parsed)
        self.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
        return "250 Message accepted for delivery"


@dataclass
class SmtpServer:
    port: int
    inbox: _Inbox
    controller: Controller | None = None

    def start(self) -> None:
        self.controller = Controller(self.inbox, hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None

    def wait_for(self, count: int, timeout_s: float = 30) -> list[EmailMessage]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.inbox.messages) >= count:
                return list(self.inbox.messages)
            time.sleep(0.02)
        raise AssertionError(f"{len(self.inbox.messages)} emails arrived, not {count}")


@contextmanager
def smtp_server(*, started: bool = True) -> Iterator[SmtpServer]:
    """A real SMTP server (aiosmtpd) on 127.0.0.1; ``started=False`` leaves it down until the
    test starts it."""
    server = SmtpServer(free_port(), _Inbox())
    if started:
        server.start()
    try:
        yield server
    finally:
        server.stop()
