"""The group commit of results: results that finish together share one write, and a result
that no running request could join goes at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import cast

from backfill.domain.records import ItemResult, Stored
from backfill.metrics import Metrics
from backfill.ports import WorkQueue
from backfill.runner.group_commit import ResultWriter


class Writes:
    """A store that keeps each write's results."""

    def __init__(self) -> None:
        self.writes: list[list[int]] = []

    async def write_results(self, results: Sequence[ItemResult]) -> Stored:
        self.writes.append([r.idx for r in results])
        return Stored([True] * len(results))


def result(idx: int) -> ItemResult:
    return ItemResult("batch", idx, "token", True, b"row", input_tokens=1, output_tokens=1)


async def put_all(writer: ResultWriter, count: int) -> float:
    """Seconds until ``count`` results put together are all stored."""
    writer.start()
    start = time.perf_counter()
    try:
        assert all(await asyncio.gather(*(writer.put(result(i)) for i in range(count))))
        return time.perf_counter() - start
    finally:
        await writer.stop()


async def test_results_that_finish_together_share_one_write() -> None:
    store = Writes()
    # Three more requests run: the pause waits for results that might join.
    writer = ResultWriter(cast(WorkQueue, store), 0.05, Metrics(), running=lambda: 5)
    await put_all(writer, 2)
    assert store.writes == [[0, 1]]


async def test_a_result_no_running_request_could_join_is_written_at_once() -> None:
    store = Writes()
    # Every request that runs is one of those waiting on this write: it does not wait 10 s.
    writer = ResultWriter(cast(WorkQueue, store), 10.0, Metrics(), running=lambda: 2)
    assert await put_all(writer, 2) < 5.0
    assert store.writes == [[0, 1]]


async def test_without_a_count_of_running_requests_it_pauses_as_configured() -> None:
    store = Writes()
    writer = ResultWriter(cast(WorkQueue, store), 0.2, Metrics())
    assert await put_all(writer, 1) >= 0.2
    assert store.writes == [[0]]
