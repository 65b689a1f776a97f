"""Remote images of a request, fetched before it takes its engine slot and sent to its engine
inline (SPEC §10.4): engines never fetch a user's URL, and a URL that cannot be fetched ends
only its own request."""

from __future__ import annotations

import asyncio
from typing import Any

from backfill.domain.media import IMAGE_TYPES, data_url, inline_images, remote_image_urls
from backfill.ports import MediaFetcher, MediaFetchFailed
from backfill.runner.replies import Outcome, failed

_NO_FETCHER = (
    "This request has a remote image URL, and this Backfill fetches none; send the image "
    "inline as a data: URL."
)


async def with_inline_images(
    fetcher: MediaFetcher | None,
    custom_id: str,
    body: dict[str, Any],
    line_bytes: int,
    *,
    total_s: float,
) -> dict[str, Any] | Outcome:
    """``body`` with its remote images inline, or the error row its request ends with. A
    line's fetched images together may hold at most ``line_bytes``, and take at most
    ``total_s`` to fetch."""
    urls = list(dict.fromkeys(remote_image_urls(body)))
    if not urls:
        return body
    if fetcher is None:
        return failed(custom_id, "image_fetch_failed", _NO_FETCHER)
    deadline = asyncio.timeout(total_s)
    try:
        async with deadline:
            return await _fetch_all(fetcher, custom_id, body, urls, line_bytes)
    except TimeoutError:
        if not deadline.expired():
            raise
        return failed(
            custom_id,
            "image_fetch_failed",
            f"The images of this request took more than {total_s:g} s to fetch together (the "
            "fetch_total_timeout_s setting); send fewer images, images from a faster host, or "
            "the images inline as data: URLs.",
        )


async def _fetch_all(
    fetcher: MediaFetcher, custom_id: str, body: dict[str, Any], urls: list[str], line_bytes: int
) -> dict[str, Any] | Outcome:
    inline: dict[str, str] = {}
    held = 0
    # One at a time: a line's images never sit in memory past its limit, whatever they weigh,
    # and a line opens one connection, whatever its number of images. Lines fetch side by
    # side in the fetch pool, and fetch_total_timeout_s bounds a line's sum.
    for url in urls:
        try:
            media = await fetcher.fetch(url, IMAGE_TYPES)
        except MediaFetchFailed as refused:
            # Refused or unreachable: retrying the same URL would meet the same rule or host,
            # so the request ends here with the reason, and its batch goes on.
            return failed(custom_id, refused.code, refused.message)
        held += len(media.data)
        if held > line_bytes:
            return failed(
                custom_id,
                "image_fetch_failed",
                f"The images of this request hold more than {line_bytes} bytes together (the "
                "max_media_bytes_per_line setting); send fewer or smaller images.",
            )
        inline[url] = data_url(media.content_type, media.data)
    return inline_images(body, inline)
