"""An ``Engine`` for any OpenAI-compatible server over HTTP (vLLM, SGLang, llama.cpp, ...)."""

from __future__ import annotations

import email.utils
import os
import re
import ssl
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import msgspec
from opentelemetry import propagate, trace

from backfill.adapters.engines.http1 import Http1Pool
from backfill.domain.output_schema import json_schema_as_json_object
from backfill.ports import EngineReply, EngineTimeout, EngineUnreachable


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def public_url(url: str) -> str:
    """``url`` without a user, password, query or fragment: what logs and the admin API may
    show of where an engine is."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# A health check that takes longer than this counts as failed.
HEALTH_TIMEOUT_S = 5.0
# What an answer other than 200 to the health check most likely means, for the operator.
_STATUS_HINTS = {
    401: "check the engine's api_key",
    403: "check the engine's api_key",
    404: "is base_url the root of an OpenAI-compatible server?",
}


# OpenSSL's words come as "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)".
_SSL_NOISE = re.compile(r"^\[[^\]]*\]\s*|\s*\(_ssl\.c:\d+\)$")


def _connect_error(exc: aiohttp.ClientConnectorError) -> str:
    """Why no connection could be made: a TLS handshake that failed, or the system's reason."""
    where = f"{exc.host}:{exc.port}"
    # Before any OSError test: an SSL error is an OSError whose errno is OpenSSL's code.
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS handshake with {where} failed: {_tls_cause(exc.os_error)}"
    return f"cannot connect to {where} ({_cause(exc.os_error)})"


def _tls_cause(error: OSError) -> str:
    """OpenSSL's reason, without its codes ("certificate verify failed (self-signed
    certificate)", "wrong version number": the port does not speak TLS)."""
    if isinstance(error, ssl.SSLCertVerificationError):
        detail = (error.verify_message or "").rstrip(".")
        return f"certificate verify failed ({detail})" if detail else "certificate verify failed"
    words = _SSL_NOISE.sub("", error.strerror or str(error)).strip()
    if words:
        return words
    if isinstance(error, ssl.SSLError) and error.reason:
        return error.reason.lower().replace("_", " ")
    return type(error).__name__


def _cause(error: OSError) -> str:
    """Why a connection failed, in the system's words ("connection refused")."""
    # asyncio words refusals as "Connect call failed (...)"; the errno says it plainly. Only
    # for an OS error: an SSL error's errno is OpenSSL's, which os.strerror misreads.
    if not isinstance(error, ssl.SSLError) and isinstance(error.errno, int) and error.errno > 0:
        return os.strerror(error.errno).lower()
    return (error.strerror or type(error).__name__).lower()


def _trace_context() -> dict[str, str] | None:
    """``traceparent`` (and ``tracestate``) of the span this request is sent in, so an engine
    that traces (vLLM's --otlp-traces-endpoint) continues Backfill's trace; None outside one,
    as always when tracing is off."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


class OpenAIHttpEngine:
    """Sends each request non-streaming, with the model renamed to the engine's served name."""

    def __init__(
        self,
        name: str,
        base_url: str,
        models: dict[str, str],
        *,
        max_concurrency: int = 16,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        api_key: str | None = None,
        priority: int | None = None,
        json_schema_as_object: bool = False,
    ) -> None:
        """``json_schema_as_object``: the engine takes a JSON Schema only as
        ``{"type": "json_object", "schema": …}`` (llama-cpp-python's server)."""
        self.name = name
        self._json_schema_as_object = json_schema_as_object
        # Sent with every request (vLLM priority scheduling; docs/scheduling.md).
        self._priority = priority
        self.base_url = base_url.rstrip("/")
        # Engines are configured with or without the /v1 suffix; request paths carry it.
        self._root = self.base_url.removesuffix("/v1")
        self.max_concurrency = max_concurrency
        self._models = models
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout_s, sock_connect=connect_timeout_s
        )
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        # Requests go through the lean client, made at the first; health checks through aiohttp.
        self._requests: Http1Pool | None = None
        self._health_error: str | None = None

    @property
    def url(self) -> str:
        return public_url(self.base_url)

    @property
    def health_error(self) -> str | None:
        return self._health_error

    @property
    def metrics_url(self) -> str:
        """Where vLLM and SGLang publish their Prometheus metrics."""
        return self._root + "/metrics"

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._models)

    def serves(self, model: str) -> bool:
        return model in self._models

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers
            )
        return self._session

    async def send(self, path: str, model: str, body: dict[str, Any]) -> EngineReply:
        payload = dict(body)
        payload["model"] = self._models.get(model, model)
        # A line carries them only where the operator lets `stream` be ignored
        # (limits.ignore_stream): the engine answers whole, as for every line.
        payload.pop("stream", None)
        payload.pop("stream_options", None)
        if self._priority is not None:
            payload["priority"] = self._priority
        if self._json_schema_as_object and "response_format" in payload:
            payload = json_schema_as_json_object(payload)
        try:
            # msgspec writes ``msgspec.Raw`` field values (the line's own JSON) through unchanged.
            answer = await self._pool().post(path, msgspec.json.encode(payload), _trace_context())
        except ValueError as exc:  # a base_url or api_key no request can carry
            raise EngineUnreachable(f"{self.name}: {exc}") from None
        except TimeoutError:
            raise EngineTimeout(f"{self.name} did not answer in time") from None
        except OSError as exc:
            raise EngineUnreachable(f"{self.name}: {type(exc).__name__}") from None
        return EngineReply(
            status=answer.status,
            body=answer.body,
            retry_after_s=parse_retry_after(answer.retry_after),
        )

    def _pool(self) -> Http1Pool:
        if self._requests is None:
            self._requests = Http1Pool(
                self._root,
                self._headers,
                connect_s=self._connect_timeout_s,
                total_s=self._request_timeout_s,
            )
        return self._requests

    async def healthy(self) -> bool:
        self._health_error = await self._check()
        return self._health_error is None

    async def _check(self) -> str | None:
        """Why ``GET /v1/models`` shows the engine cannot take requests; None when it can."""
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        try:
            async with self._client().get(self._root + "/v1/models", timeout=timeout) as r:
                status = r.status
        except TimeoutError:
            return f"GET /v1/models did not answer within {HEALTH_TIMEOUT_S:g} s"
        except aiohttp.ClientConnectorError as exc:
            return _connect_error(exc)
        except (aiohttp.ClientError, OSError) as exc:
            return f"GET /v1/models failed: {type(exc).__name__}"
        if status == 200:
            return None
        hint = _STATUS_HINTS.get(status)
        return f"GET /v1/models answered HTTP {status}" + (f" ({hint})" if hint else "")

    async def close(self) -> None:
        if self._requests is not None:
            self._requests.close()
        if self._session is not None:
            await self._session.close()
