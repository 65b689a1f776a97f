"""Giving an engine call back: the latest go first, the caller learns it was given back, and
a cancellation of the caller itself stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from backfill.runner.give_back import GivenBack, Sends


async def test_the_latest_calls_are_given_back_and_say_so() -> None:
    sends = Sends()
    gates = [asyncio.Event() for _ in range(4)]

    async def call(i: int) -> int:
        await gates[i].wait()
        return i

    tasks = [asyncio.create_task(sends.run(call(i))) for i in range(4)]
    await asyncio.sleep(0)
    assert len(sends) == 4
    assert sends.give_back(2) == 2
    for gate in gates:
        gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[:2] == [0, 1]
    assert all(isinstance(r, GivenBack) for r in results[2:])
    assert len(sends) == 0


async def test_a_cancelled_caller_is_cancelled_not_given_back() -> None:
    sends = Sends()
    task = asyncio.create_task(sends.run(asyncio.sleep(60)))
    await asyncio.sleep(0)
    sends.give_back(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_giving_back_more_than_run_gives_what_there_is() -> None:
    sends = Sends()
    assert sends.give_back(3) == 0
