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
    caller's work is Python: a million-line creation or finalize keeps both cores busy.

    A caller that leaves early (an error, its task cancelled) waits for the read in flight to
    finish, then the stream is closed: a read is never cancelled within its statement, where
    cancelling can strand the pooled connection it holds."""
    upcoming: asyncio.Future[_T] = asyncio.ensure_future(anext(pages))
    try:
        while True:
            try:
                # Shielded: cancelling the caller must not cancel the read.
                page = await asyncio.shield(upcoming)
            except StopAsyncIteration:
                return
            upcoming = asyncio.ensure_future(anext(pages))
            yield page
    finally:
        # wait() neither raises the read's outcome nor swallows a cancellation of the caller;
        # the read's own error, if any, is the caller's no more once it has left.
        await asyncio.wait([upcoming])
        if not upcoming.cancelled():
            upcoming.exception()
        close = getattr(pages, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
