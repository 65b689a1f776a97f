"""read_ahead: the same pages in the same order, one read ahead, and nothing left running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from backfill.domain.streams import read_ahead


async def test_pages_arrive_in_order_with_the_next_one_read_meanwhile() -> None:
    read: list[int] = []

    async def pages() -> AsyncIterator[int]:
        for n in range(4):
            read.append(n)
            yield n

    seen = []
    async for page in read_ahead(pages()):
        await asyncio.sleep(0)  # the caller's own work: the next page is read meanwhile
        seen.append((page, list(read)))
    assert [page for page, _ in seen] == [0, 1, 2, 3]
    assert seen[0][1] == [0, 1], "the second page was not read while the first was used"


async def test_an_error_of_the_stream_reaches_the_caller_at_its_page() -> None:
    async def pages() -> AsyncIterator[int]:
        yield 1
        raise OSError("storage failed")

    got = []

    async def read_all() -> None:
        async for page in read_ahead(pages()):
            got.append(page)

    with pytest.raises(OSError, match="storage failed"):
        await read_all()
    assert got == [1]


async def test_a_caller_that_stops_early_leaves_no_read_running() -> None:
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def pages() -> AsyncIterator[int]:
        yield 1
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield 2

    stream = read_ahead(pages())
    async for _ in stream:
        await started.wait()
        break
    await stream.aclose()
    assert cancelled == [True]
