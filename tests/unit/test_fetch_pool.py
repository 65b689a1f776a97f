"""The fetch pool's places: how many requests fetch at once, how many more wait, and when a
request that found it full is told it may come back."""

from __future__ import annotations

import asyncio

import pytest

from backfill.runner.fetch_pool import FetchPool


def test_the_pool_admits_its_places_and_as_many_waiting_then_turns_away() -> None:
    pool = FetchPool(2)
    assert [pool.admit() for _ in range(5)] == [True, True, True, True, False]
    assert pool.admitted == 4
    pool.leave()
    assert pool.admit()
    assert not pool.admit()


def test_room_is_announced_only_after_a_request_was_turned_away() -> None:
    told: list[int] = []
    pool = FetchPool(1)
    pool.on_free = lambda: told.append(pool.admitted)
    assert pool.admit()
    assert pool.admit()
    pool.leave()
    assert told == []  # nobody waits to come back: no claim for nothing
    assert pool.admit()
    assert not pool.admit()
    pool.leave()
    pool.leave()
    assert told == [1]  # once, when the first place freed up


async def test_at_most_its_places_fetch_at_once() -> None:
    pool = FetchPool(2)
    running = peak = 0

    async def fetch() -> None:
        nonlocal running, peak
        async with pool.place:
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1

    await asyncio.gather(*(fetch() for _ in range(6)))
    assert peak == 2


def test_a_pool_needs_a_place() -> None:
    with pytest.raises(ValueError, match="at least one place"):
        FetchPool(0)
