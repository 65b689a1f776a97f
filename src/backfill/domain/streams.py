"""Async streams of pages, read one page ahead of their consumer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

_T = TypeVar("_T")


async def read_ahead(pages: AsyncIterator[_T]) -> AsyncGenerator[_T, None]:
    """``pages``, the next one read while the caller works on the one before. Worth it where
    the reading waits on a database or storage thread (which runs without the GIL) and the
    caller's work is Python: a million-line creation or finalize keeps both cores busy."""
    upcoming: asyncio.Future[_T] = asyncio.ensure_future(anext(pages))
    try:
        while True:
            try:
                page = await upcoming
            except StopAsyncIteration:
                return
            upcoming = asyncio.ensure_future(anext(pages))
            yield page
    finally:
        upcoming.cancel()
        # Ended before the stream is closed: closing one that is still running fails.
        await asyncio.wait([upcoming])
        with contextlib.suppress(asyncio.CancelledError, Exception):
            upcoming.result()
