"""``SafeFetcher``: the ``MediaFetcher`` for users' remote images (SPEC §10.4)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection

import aiohttp
from yarl import URL

from backfill.adapters.fetch.policy import FetchPolicy, Refused
from backfill.adapters.fetch.resolver import Lookup, system_lookup
from backfill.adapters.fetch.safe_client import SafeClient
from backfill.adapters.fetch.urls import shown
from backfill.domain.media import has_signature
from backfill.ports import FetchedMedia, MediaFetchFailed

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_UNPRINTABLE = re.compile(r"[^!-~]")


class SafeFetcher:
    """Fetches public HTTPS URLs within the policy's size, time and redirect limits.

    Each redirect target is checked like the URL given; the whole fetch, redirects and body
    included, ends at ``policy.timeout_s``. Every failure is a ``MediaFetchFailed`` naming the
    URL's host and the rule, never content."""

    def __init__(
        self,
        policy: FetchPolicy,
        *,
        lookup: Lookup = system_lookup,
    ) -> None:
        self.policy = policy
        self._client = SafeClient(policy, lookup=lookup)

    async def fetch(self, url: str, content_types: Collection[str]) -> FetchedMedia:
        # Sorted so that a message names them in one order, whatever collection they came in.
        wanted = tuple(sorted({t.strip().lower() for t in content_types}))
        where = shown(url)
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                target = self._client.check(url)
                for hop in range(self.policy.max_redirects + 1):
                    async with self._client.request("GET", target) as response:
                        if response.status not in _REDIRECTS:
                            return await self._read(response, wanted)
                        if hop == self.policy.max_redirects:
                            where = shown(url)
                            raise Refused(
                                f"it redirects more than {self.policy.max_redirects} times"
                            )
                        target = self._redirect(target, response)
                        where = f"{shown(url)} (redirected to {shown(target)})"
                        target = self._client.check(target)
        except Refused as exc:
            raise MediaFetchFailed(f"{where}: {exc.reason}") from None
        except TimeoutError:
            raise MediaFetchFailed(
                f"{where}: no complete answer within {self.policy.timeout_s:g} s"
            ) from None
        raise AssertionError("unreachable: the last hop returns or raises")

    @staticmethod
    def _redirect(current: URL, response: aiohttp.ClientResponse) -> URL:
        location = response.headers.get("Location")
        if not location:
            raise Refused(f"the server answered {response.status} without a Location")
        try:
            return current.join(URL(location))
        except ValueError:
            raise Refused("the server redirects to a URL that is not valid") from None

    async def _read(
        self, response: aiohttp.ClientResponse, wanted: tuple[str, ...]
    ) -> FetchedMedia:
        if response.status != 200:
            raise Refused(f"the server answered {response.status}")
        header = response.headers.get("Content-Type", "")
        content_type = header.split(";", 1)[0].strip().lower()
        if not content_type:
            raise Refused(f"the answer has no content type; one of {', '.join(wanted)} is needed")
        if content_type not in wanted:
            # The header is the server's text: shown short and printable only.
            named = _UNPRINTABLE.sub("?", content_type[:100])
            raise Refused(f"the content type {named} is not one of {', '.join(wanted)}")
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise Refused("the body is sent compressed; Backfill reads only uncompressed bodies")
        limit = self.policy.max_bytes
        too_large = f"the body is larger than {limit} bytes"
        if response.content_length is not None and response.content_length > limit:
            raise Refused(too_large)
        body = bytearray()
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise Refused(too_large)
        data = bytes(body)
        if not has_signature(content_type, data):
            raise Refused(
                f"the body is not {content_type}: its first bytes are not those of that type "
                "(a page, or a compressed body, sent as an image?)"
            )
        return FetchedMedia(content_type=content_type, data=data)

    async def close(self) -> None:
        await self._client.close()
