"""The small HTTP server of a ``serve --role worker`` process (``worker.http_port``): liveness,
readiness and this process's own /metrics, which no API process can report for it: what a
worker counts itself (results, tokens, engine attempts, notifications, damaged files) lives
only in its registry (docs/observability.md, "Metrics").

aiohttp's web server rather than a second uvicorn: aiohttp is already what the worker's engine
clients are built on, its runner starts and stops as plain awaits on the worker's event loop,
installs no signal handlers (the worker has its own) and has no lifespan to turn off, and a
port that cannot be bound raises OSError here instead of uvicorn's start-up exiting the
process, so the operator gets one clear message."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from enum import Enum

from aiohttp import web

from backfill.adapters.http.auth import FailureBrake, bearer, secret_matches
from backfill.adapters.http.envelope import envelope
from backfill.errors import BackfillError, Unauthorized

log = logging.getLogger("backfill.probe")

# The same content type as the API's /metrics: Prometheus' text format 0.0.4.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Probe and scrape handlers finish in well under this; a stop does not wait longer for them.
_SHUTDOWN_S = 2.0


class Phase(Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


class WorkerProbe:
    """``GET /healthz`` (the process is alive), ``GET /readyz`` (200 once the worker has started
    and until it begins to stop, 503 with the reason otherwise) and ``GET /metrics`` (behind
    ``metrics_token`` when set, as on the API) on ``host:port``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        render_metrics: Callable[[], Awaitable[bytes]],
        metrics_token: str | None,
        brake: FailureBrake | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._render = render_metrics
        self._token = metrics_token
        self._brake = brake
        self.phase = Phase.STARTING
        self._runner: web.AppRunner | None = None

    def mark_ready(self) -> None:
        self.phase = Phase.READY

    def mark_stopping(self) -> None:
        self.phase = Phase.STOPPING

    async def start(self) -> None:
        """Listen on ``host:port``; a port that cannot be bound is the operator's to fix."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz, allow_head=False)
        app.router.add_get("/readyz", self._readyz, allow_head=False)
        app.router.add_get("/metrics", self._metrics, allow_head=False)
        # No access log: a probe every few seconds would drown the worker's own lines.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise BackfillError(self._bind_problem(exc)) from None
        self._runner = runner
        log.info("worker probes and /metrics on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _bind_problem(self, exc: OSError) -> str:
        where = f"{self.host}:{self.port}"
        if exc.errno == errno.EADDRINUSE:
            return (
                f"worker.http_port: {where} is already in use (another worker on this "
                "machine?). Give each worker its own port (BACKFILL_WORKER__HTTP_PORT), or "
                "leave it unset."
            )
        return f"worker.http_port: cannot listen on {where}: {exc.strerror or exc}"

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.phase is Phase.READY:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready", "reason": self.phase.value}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._token:
            refusal = self._refusal(request, self._token)
            if refusal is not None:
                return refusal
        try:
            body = await self._render()
        except Exception as exc:  # the database gauges are read at each scrape
            log.warning("worker /metrics: could not read the gauges: %s", exc)
            return _error(
                503,
                "Metrics could not be read now; see the worker's log.",
                type_="server_error",
                code="metrics_unavailable",
                retryable=True,
            )
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _refusal(self, request: web.Request, token: str) -> web.Response | None:
        """The API's check (EdgeGuard and the /metrics route): a wrong or missing bearer gets
        401, counted by the per-address brake, and a braked address 429."""
        client = request.remote or ""
        if self._brake is not None:
            braked = self._brake.refusal(client)
            if braked is not None:
                headers = {"Retry-After": str(braked.retry_after_s)}
                return _error_of(braked, headers)
        # As uvicorn gives them to the API: header names in lower case, values as sent.
        raw = ((name.lower(), value) for name, value in request.raw_headers)
        if secret_matches(bearer(raw), token):
            return None
        if self._brake is not None:
            self._brake.record_failure(client)
        return _error_of(
            Unauthorized(
                "Metrics need 'Authorization: Bearer <metrics_token>'.",
                code="invalid_metrics_token",
            )
        )


def _error_of(exc: BackfillError, headers: dict[str, str] | None = None) -> web.Response:
    return _error(
        exc.status,
        exc.message,
        type_=exc.type,
        code=exc.code,
        retryable=exc.retryable,
        headers=headers,
    )


def _error(
    status: int,
    message: str,
    *,
    type_: str,
    code: str,
    retryable: bool,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """The API's error envelope and ``x-should-retry``, so a scraper sees the same answers."""
    return web.Response(
        body=envelope(message, type_=type_, code=code),
        status=status,
        content_type="application/json",
        headers={"x-should-retry": "true" if retryable else "false", **(headers or {})},
    )
