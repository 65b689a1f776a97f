"""Remote images of a request, fetched when it runs and sent to its engine inline (SPEC §10.4):
engines never fetch a user's URL, and a URL that cannot be fetched ends only its own request."""

from __future__ import annotations

import asyncio
from typing import Any

from backfill.domain.media import IMAGE_TYPES, data_url, inline_images, remote_image_urls
from backfill.ports import MediaFetcher, MediaFetchFailed
from backfill.runner.replies import Outcome, failed

_NO_FETCHER = (
    "This request has an https image URL, and this Backfill fetches none; send the image "
    "inline as a data: URL."
)


async def with_inline_images(
    fetcher: MediaFetcher | None, custom_id: str, body: dict[str, Any]
) -> dict[str, Any] | Outcome:
    """``body`` with its https images inline, or the error row its request ends with."""
    urls = list(dict.fromkeys(remote_image_urls(body)))
    if not urls:
        return body
    if fetcher is None:
        return failed(custom_id, "image_fetch_failed", _NO_FETCHER)
    refusal: MediaFetchFailed | None = None
    try:
        # A task group: the first refusal cancels the other fetches of the line.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(fetcher.fetch(url, IMAGE_TYPES)) for url in urls]
    except* MediaFetchFailed as refused:
        first = refused.exceptions[0]
        assert isinstance(first, MediaFetchFailed)
        refusal = first
    if refusal is not None:
        # Refused or unreachable: retrying the same URL would meet the same rule or host, so
        # the request ends here with the reason, and its batch goes on.
        return failed(custom_id, refusal.code, refusal.message)
    inline = {
        url: data_url(task.result().content_type, task.result().data)
        for url, task in zip(urls, tasks, strict=True)
    }
    return inline_images(body, inline)
