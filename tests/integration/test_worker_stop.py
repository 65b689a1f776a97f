"""Stopping a worker leaves no task of its own running: what a lifecycle pass under way starts
as the stop begins is waited for too, so no pooled connection outlives the store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.simulator.server import Simulator
from tests.support import chat_line, in_process_backfill, jsonl


async def test_a_finalize_started_by_the_pass_under_way_at_stop_is_waited_for(
    tmp_path: Path, sim: tuple[str, Simulator], monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = asyncio.Event()
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        store, worker = bf.backfill.store, bf.backfill.worker
        assert worker is not None
        stopping = worker._loops.stopping  # the event ``stop`` sets first
        read = store.lifecycle_batches

        async def held_until_the_stop(now: float) -> list[BatchRecord]:
            # The pass that finds the drained batch returns only once the stop has begun,
            # so the finalize it starts comes after the stop looked at what runs.
            batches = await read(now)
            if not entered.is_set() and any(b.status == BatchStatus.FINALIZING for b in batches):
                entered.set()
                await stopping.wait()
            return batches

        monkeypatch.setattr(store, "lifecycle_batches", held_until_the_stop)
        uploaded = await bf.upload(jsonl([chat_line(f"r{i}") for i in range(3)]))
        created = await bf.create(uploaded.json()["id"])
        assert created.status_code == 200, created.text
        await asyncio.wait_for(entered.wait(), 30)
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("finalize-")]
    assert left == [], f"the stop returned with {left} still running"
