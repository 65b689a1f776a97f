"""An ``Engine`` for any OpenAI-compatible server over HTTP (vLLM, SGLang, llama.cpp, ...)."""

from __future__ import annotations

import email.utils
import time
from typing import Any

import aiohttp
import msgspec

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
    ) -> None:
        self.name = name
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
        payload.pop("stream", None)
        if self._priority is not None:
            payload["priority"] = self._priority
        url = self._root + path
        try:
            # msgspec writes ``msgspec.Raw`` field values (the line's own JSON) through unchanged.
            data = msgspec.json.encode(payload)
            async with self._client().post(url, data=data) as response:
                return EngineReply(
                    status=response.status,
                    body=await response.read(),
                    retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
                )
        except TimeoutError:
            raise EngineTimeout(f"{self.name} did not answer in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnreachable(f"{self.name}: {type(exc).__name__}") from None

    async def healthy(self) -> bool:
        url = self._root + "/v1/models"
        try:
            async with self._client().get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
