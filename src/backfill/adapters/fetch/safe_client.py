"""An aiohttp client that connects only where the fetch rules allow."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aiohttp
from yarl import URL

from backfill.adapters.fetch.policy import AddressRule, FetchPolicy, Refused
from backfill.adapters.fetch.resolver import Lookup, PublicOnlyResolver, system_lookup
from backfill.adapters.fetch.urls import checked_url

# Identity only, and nothing inflated (auto_decompress off): a few compressed bytes can
# inflate far past the size limit before they could be counted.
_HEADERS = {"User-Agent": "Backfill", "Accept": "*/*", "Accept-Encoding": "identity"}


class SafeClient:
    """Requests to checked URLs, one hop each (redirects are the caller's to check and follow).

    No proxy from the environment (it would connect on the fetch's behalf, past the address
    check), no cookie kept between requests, no credentials sent."""

    def __init__(
        self,
        policy: FetchPolicy,
        *,
        lookup: Lookup = system_lookup,
    ) -> None:
        self.policy = policy
        self._rule = AddressRule(policy)
        self._lookup = lookup
        self._ssl: ssl.SSLContext | bool = (
            policy.ssl_context if policy.ssl_context is not None else True
        )
        self._session: aiohttp.ClientSession | None = None

    def check(self, url: str | URL) -> URL:
        """``url`` parsed, or ``Refused`` naming the rule it breaks."""
        return checked_url(url, self.policy, self._rule)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                resolver=PublicOnlyResolver(self._rule, self._lookup),
                # Each new connection resolves and checks anew, so what it connects to is
                # what was checked for it, whatever the name answered before.
                use_dns_cache=False,
                ssl=self._ssl,
                keepalive_timeout=15,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                auto_decompress=False,
                headers=_HEADERS,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.policy.connect_timeout_s
                ),
            )
        return self._session

    @asynccontextmanager
    async def request(
        self,
        method: str,
        url: URL,
        *,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The answer to one request to ``url`` (already ``check``-ed); what goes wrong on the
        way, reading the body included, is raised as ``Refused``."""
        try:
            async with self._client().request(
                method, url, data=data, headers=headers, allow_redirects=False
            ) as response:
                yield response
        except Refused:
            raise
        except aiohttp.ClientError as exc:
            raise Refused(self._reason(exc)) from None

    def _reason(self, exc: aiohttp.ClientError) -> str:
        refusal = _cause(exc)
        if refusal is not None:
            return refusal.reason
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            problem = exc.certificate_error
            detail = getattr(problem, "verify_message", None) or type(problem).__name__
            return f"the server's TLS certificate could not be verified ({detail.rstrip('.')})"
        if isinstance(exc, aiohttp.ClientSSLError):
            return "the TLS handshake with the server failed"
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"the server could not be reached within {self.policy.connect_timeout_s:g} s"
        if isinstance(exc, aiohttp.ClientConnectorDNSError):
            return "the host name does not resolve"
        if isinstance(exc, aiohttp.ClientConnectorError):
            return f"the server could not be reached ({exc.strerror or type(exc).__name__})"
        if isinstance(exc, aiohttp.ClientResponseError):
            return "the server's answer is not valid HTTP"
        if isinstance(exc, aiohttp.InvalidURL):
            return "the URL is not valid"
        if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientConnectionError):
            return "the connection broke off before the answer was complete"
        return f"the request failed ({type(exc).__name__})"

    async def post_json(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> int:
        """POST ``body`` to ``url`` under the same address rules and answer the status code.
        Redirects are not followed: a 3xx is the answer. Raises ``Refused``."""
        target = self.check(url)
        sent = {"Content-Type": "application/json", **headers}
        try:
            async with (
                asyncio.timeout(timeout_s),
                self.request("POST", target, data=body, headers=sent) as response,
            ):
                return response.status
        except TimeoutError:
            raise Refused(f"no answer within {timeout_s:g} s") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _cause(exc: BaseException) -> Refused | None:
    """The resolver's refusal, which aiohttp wraps in its own connection error."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, Refused):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
