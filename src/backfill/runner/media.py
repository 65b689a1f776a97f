"""Remote images of a request, fetched when it runs and sent to its engine inline (SPEC §10.4):
engines never fetch a user's URL, and a URL that cannot be fetched ends only its own request."""

from __future__ import annotations

from typing import Any

from backfill.domain.media import IMAGE_TYPES, data_url, inline_images, remote_image_urls
from backfill.ports import MediaFetcher, MediaFetchFailed
from backfill.runner.replies import Outcome, failed

_NO_FETCHER = (
    "This request has an https image URL, and this Backfill fetches none; send the image "
    "inline as a data: URL."
)


async def with_inline_images(
    fetcher: MediaFetcher | None, custom_id: str, body: dict[str, Any], line_bytes: int
) -> dict[str, Any] | Outcome:
    """``body`` with its https images inline, or the error row its request ends with. A line's
    fetched images together may hold at most ``line_bytes``."""
    urls = list(dict.fromkeys(remote_image_urls(body)))
    if not urls:
        return body
    if fetcher is None:
        return failed(custom_id, "image_fetch_failed", _NO_FETCHER)
    inline: dict[str, str] = {}
    held = 0
    # One at a time: a line's images never sit in memory past its limit, whatever they weigh.
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
