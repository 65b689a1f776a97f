"""Engine slots and health: how many requests each engine may take right now."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

from backfill.domain.records import ClaimedItem, WorkBatch
from backfill.ports import Engine
from backfill.runner.inputs import ClaimInput

log = logging.getLogger("backfill.runner")


@dataclass(frozen=True, slots=True)
class Queued:
    """A claimed request waiting for a free slot of its engine."""

    batch: WorkBatch
    item: ClaimedItem
    input: ClaimInput


class EngineSlot:
    """One engine with its in-flight count and last known health."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.in_flight = 0
        self.healthy = False
        # Claimed items waiting for a free slot: a quarter of the slots' worth at most.
        self.backlog: deque[Queued] = deque()
        self.prefetch = max(1, engine.max_concurrency // 4)

    @property
    def free(self) -> int:
        return max(0, self.engine.max_concurrency - self.in_flight) if self.healthy else 0

    @property
    def claim_threshold(self) -> int:
        """Claim once this many items are wanted: fewer, larger claims cost less CPU."""
        return max(1, self.prefetch // 2)

    @property
    def wanted(self) -> int:
        """How many more items to claim for this engine now."""
        if not self.healthy:
            return 0
        return max(
            0, self.engine.max_concurrency + self.prefetch - self.in_flight - len(self.backlog)
        )


class EnginePool:
    def __init__(self, engines: list[Engine], freed: asyncio.Event) -> None:
        self.slots = [EngineSlot(e) for e in engines]
        self._freed = freed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="engine-health")

    async def _watch(self) -> None:
        while True:
            for slot in self.slots:
                await self.check(slot)
            healthy = all(s.healthy for s in self.slots)
            await asyncio.sleep(5.0 if healthy else 0.5)

    async def check(self, slot: EngineSlot) -> bool:
        was = slot.healthy
        slot.healthy = await slot.engine.healthy()
        if slot.healthy != was:
            log.info("engine %s is %s", slot.engine.name, "up" if slot.healthy else "down")
            if slot.healthy:
                self._freed.set()
        return slot.healthy

    def release(self, slot: EngineSlot) -> None:
        slot.in_flight -= 1
        self._freed.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for slot in self.slots:
            await slot.engine.close()
