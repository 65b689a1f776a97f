"""A polling loop's pace: base while it finds work, doubling up to its idle period while it finds
none, woken at once, hurried to within its base."""

from __future__ import annotations

import asyncio
import itertools
import time

from backfill.runner.loops import Loops, Pace


def test_the_wait_doubles_while_nothing_is_found_and_drops_back_when_something_is() -> None:
    pace = Pace(0.2, 5.0)
    waits = []
    for _ in range(7):
        pace.found(False)
        waits.append(pace.wait_s)
    assert waits == [0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    pace.found(True)
    assert pace.wait_s == 0.2


def test_an_idle_period_below_the_base_is_the_base() -> None:
    pace = Pace(1.0, 0.5)
    pace.found(False)
    assert pace.wait_s == 1.0


async def test_wake_ends_a_long_pause_at_once() -> None:
    pace = Pace(0.01, 30.0)
    for _ in range(20):
        pace.found(False)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, pace.wake)
    started = time.monotonic()
    await asyncio.wait_for(pace.pause(), 5)
    # Bounds in the pace's own terms: a tenth of the pause it was in, not the whole of it.
    assert time.monotonic() - started < pace.idle_s / 10
    assert pace.wait_s == 0.01


async def test_a_wake_during_the_poll_ends_the_next_pause() -> None:
    pace = Pace(10.0, 10.0)
    pace.wake()  # while "polling": nothing waits yet
    await asyncio.wait_for(pace.pause(), 1)


async def test_hurry_ends_a_long_pause_one_base_after_it_began() -> None:
    pace = Pace(0.1, 30.0)
    for _ in range(20):
        pace.found(False)
    asyncio.get_running_loop().call_later(0.01, pace.hurry)
    started = time.monotonic()
    await asyncio.wait_for(pace.pause(), 5)
    took = time.monotonic() - started
    # At least half the base after the pause began (the hurry came 0.01 s in), far from the
    # idle period.
    assert pace.base_s / 2 < took < pace.idle_s / 10
    pace.found(False)  # the poll after a hurry is followed by the base wait
    assert pace.wait_s == 0.1


async def test_hurry_during_the_poll_makes_the_next_wait_the_base() -> None:
    pace = Pace(0.1, 30.0)
    for _ in range(20):
        pace.found(False)
    pace.hurry()
    pace.found(False)
    assert pace.wait_s == 0.1


async def test_a_loop_polls_less_often_while_it_finds_nothing_and_stop_ends_its_wait() -> None:
    loops = Loops()
    polls: list[float] = []

    async def poll() -> bool:
        polls.append(time.monotonic())
        return False

    pace = Pace(0.02, 60.0)
    loops.poll("test", pace, poll)
    await asyncio.sleep(0.5)
    # 0.02, 0.04, 0.08, 0.16, 0.32 apart: about five polls in half a second, not twenty-five.
    assert 3 <= len(polls) <= 7
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    assert gaps[-1] > gaps[0]
    loops.stop()
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*loops.tasks), 5)
    assert time.monotonic() - started < pace.idle_s / 10, "stop ends the loop's wait at once"
