"""The worker's loops: named tasks that run their job on a cadence and end when stopped."""

from __future__ import annotations

import asyncio

from backfill.runner.loops import Loops, end_within


async def test_loops_are_named_tasks_that_end_when_stopped() -> None:
    loops = Loops()
    runs: list[str] = []

    async def job(name: str) -> None:
        runs.append(name)

    loops.every("at-once", 3600, lambda: job("at-once"), at_once=True)
    loops.every("later", 3600, lambda: job("later"))
    await asyncio.sleep(0.01)
    assert sorted(task.get_name() for task in loops.tasks) == ["at-once", "later"]
    # One runs at once; the other waits a period first (an hour), and is not run at stop.
    assert runs == ["at-once"]
    loops.stopping.set()
    await asyncio.wait_for(asyncio.gather(*loops.tasks), 30)
    assert runs == ["at-once"]


async def test_a_step_that_fails_is_run_again() -> None:
    loops = Loops()
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the database blipped")
        loops.stopping.set()

    loops.repeat("flaky", flaky)
    await asyncio.wait_for(asyncio.gather(*loops.tasks), 30)
    assert calls == 2


async def test_end_within_cancels_and_returns_only_the_tasks_still_running_at_the_grace() -> None:
    quick = asyncio.create_task(asyncio.sleep(0.01))
    slow = asyncio.create_task(asyncio.sleep(30))
    cut = await end_within([quick, slow], 0.2)
    assert cut == {slow}
    assert slow.cancelled()
    assert quick.done()
    assert not quick.cancelled()
    assert await end_within([], 1.0) == set()
