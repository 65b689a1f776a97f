"""read_ahead: the same pages in the same order, one read ahead, and nothing left running."""

from __future__ import annotations

import asyncio
import contextlib
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


async def test_a_caller_that_stops_early_lets_the_read_in_flight_finish_then_closes() -> None:
    reading, finish = asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def pages() -> AsyncIterator[int]:
        try:
            yield 1
            reading.set()
            await finish.wait()  # the read in flight when the caller leaves
            events.append("read finished")
            yield 2
            events.append("read past the caller")
        finally:
            events.append("closed")

    stream = read_ahead(pages())
    async for _ in stream:
        await reading.wait()
        break
    closing = asyncio.create_task(stream.aclose())
    await asyncio.sleep(0.01)
    assert not closing.done(), "the stream closed under a read in flight"
    finish.set()
    await closing
    assert events == ["read finished", "closed"]


async def test_cancelling_the_caller_does_not_cancel_the_read() -> None:
    finish = asyncio.Event()
    events: list[str] = []

    async def pages() -> AsyncIterator[int]:
        try:
            await finish.wait()
            events.append("read finished")
            yield 1
        except asyncio.CancelledError:
            events.append("read cancelled")
            raise
        finally:
            events.append("closed")

    async def consume() -> None:
        async with contextlib.aclosing(read_ahead(pages())) as stream:
            async for _ in stream:
                pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done(), "the caller left before the read in flight ended"
    finish.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["read finished", "closed"]
