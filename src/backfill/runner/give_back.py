"""A shared engine's requests in flight, in the order they started, so that the latest can
be given back when people wait for a slot Backfill holds (docs/scheduling.md).

Giving a request back cancels its engine call: the connection closes, and vLLM aborts a
request whose client went away, so its slot is free at the engine's next step. The request
ends with ``GivenBack``; its caller returns its line to the queue, uncharged and with no
attempt counted. The latest go first: they have done the least work, so the least is thrown
away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class GivenBack(Exception):
    """The engine call was given back to people waiting for its slot."""


class Sends:
    def __init__(self) -> None:
        # Insertion order is start order (dicts keep it): the latest are at the end.
        self._live: dict[asyncio.Future[Any], None] = {}
        self._given: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._live)

    async def run(self, call: Awaitable[T]) -> T:
        """Await ``call`` as a request that may be given back (then: ``GivenBack``)."""
        future: asyncio.Future[T] = asyncio.ensure_future(call)
        self._live[future] = None
        try:
            return await future
        except asyncio.CancelledError:
            if future in self._given and not _cancelling():
                raise GivenBack from None
            raise
        finally:
            self._live.pop(future, None)
            self._given.discard(future)

    def give_back(self, count: int) -> int:
        """Cancel the ``count`` latest calls; how many were."""
        latest = [f for f in reversed(self._live) if f not in self._given][:count]
        for future in latest:
            self._given.add(future)
            future.cancel()
        return len(latest)


def _cancelling() -> bool:
    """Whether the task awaiting the call is itself being cancelled (the batch was cancelled,
    or the worker stops): then the cancellation is its, not a give-back."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
