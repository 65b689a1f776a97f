"""Engine slots and health: how many requests each engine may take now, and the claimed
requests waiting for one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from backfill.domain.concurrency import ConcurrencyLimit, Mode, Pressure
from backfill.domain.records import ClaimedItem, WorkBatch
from backfill.ports import Engine, PressureProbe
from backfill.runner.inputs import ClaimInput

log = logging.getLogger("backfill.runner")


@dataclass(frozen=True, slots=True)
class Queued:
    """A claimed request waiting for a free slot of its engine."""

    batch: WorkBatch
    item: ClaimedItem
    input: ClaimInput


Start = Callable[["EngineSlot", Queued], None]
"""Runs a queued request on the slot that just counted it in flight; must not block."""

# A shared engine whose metrics cannot be read is looked at again this much later.
_PROBE_RETRY_S = 5.0


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the engines are shared with interactive traffic, by engine name: each named one
    has its own adaptive limit (and a metrics probe when it publishes its load); the others
    are dedicated, filled up to their ``max_concurrency``."""

    limits: Mapping[str, ConcurrencyLimit] = field(default_factory=dict)
    probes: Mapping[str, PressureProbe] = field(default_factory=dict)
    probe_interval_s: float = 0.1


class EngineSlot:
    """One engine: its in-flight count, its claimed backlog and its last known health.

    Only these methods change them. A request that ends calls ``done``; its slot goes at once
    to the next queued request (through ``start``), so a busy engine never waits for a claim
    round trip, and ``wake`` tells the dispatcher to claim more.
    """

    def __init__(
        self,
        engine: Engine,
        start: Start,
        wake: Callable[[], None],
        limit: ConcurrencyLimit | None = None,
    ) -> None:
        self.engine = engine
        self.governor = limit or ConcurrencyLimit(engine.max_concurrency, Mode.DEDICATED)
        self._start = start
        self._wake = wake
        self._in_flight = 0
        self._healthy = False
        self._backlog: deque[Queued] = deque()
        self._resume: asyncio.TimerHandle | None = None

    @property
    def limit(self) -> int:
        """Requests this engine may have in flight now (its governor decides)."""
        governor = self.governor
        # Only an engine that was ever paused reads the clock: this runs on every start.
        return governor.allowed(time.monotonic()) if governor.paused_until else governor.limit

    @property
    def prefetch(self) -> int:
        """Claimed items kept waiting for a free slot: a quarter of the limit's worth."""
        limit = self.governor.limit
        return max(1, limit // 4) if limit > 0 else 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def backlog(self) -> tuple[Queued, ...]:
        return tuple(self._backlog)

    @property
    def free(self) -> int:
        return max(0, self.limit - self._in_flight) if self._healthy else 0

    @property
    def claim_threshold(self) -> int:
        """Claim once this many items are wanted: fewer, larger claims cost less CPU."""
        return max(1, self.prefetch // 2)

    @property
    def wanted(self) -> int:
        """How many more items to claim for this engine now."""
        limit = self.limit
        if not self._healthy or limit <= 0:
            return 0
        return max(0, limit + self.prefetch - self._in_flight - len(self._backlog))

    def offer(self, queued: Iterable[Queued]) -> None:
        """Queue claimed requests; as many as there are free slots start now."""
        self._backlog.extend(queued)
        self._fill()

    def done(self) -> None:
        """A request started by this slot ended: its place goes to the next queued one."""
        if self._in_flight <= 0:
            raise RuntimeError(f"engine {self.engine.name}: a request ended that never started")
        self._in_flight -= 1
        self._wake()
        self._fill()

    def succeeded(self, latency_s: float, output_tokens: int) -> None:
        """One of Backfill's requests got its answer in ``latency_s`` (the latency signal)."""
        if self.governor.on_latency(latency_s, output_tokens, time.monotonic()):
            self._retune()

    def overloaded(self, retry_after_s: float | None) -> None:
        """The engine answered 429 or 503: a shared engine takes fewer, after a pause."""
        governor = self.governor
        governor.on_overload(retry_after_s, time.monotonic())
        if governor.paused_until and self._resume is None:
            delay = max(0.0, governor.paused_until - time.monotonic())
            self._resume = asyncio.get_running_loop().call_later(delay, self._resumed)

    def pressure(self, pressure: Pressure | None) -> None:
        """The engine's metrics were read (None: they could not be)."""
        if pressure is None:
            self.governor.on_metrics_lost()
        elif self.governor.on_pressure(pressure, self._in_flight):
            self._retune()

    def _resumed(self) -> None:
        self._resume = None
        self._retune()

    def _retune(self) -> None:
        """The limit moved: start what now fits, and claim more if it grew."""
        self._wake()
        self._fill()

    def drop(self, where: Callable[[WorkBatch], bool]) -> list[Queued]:
        """Take the queued requests of the batches ``where`` selects out of the backlog; the
        caller gives their leases back."""
        dropped: list[Queued] = []
        keep: deque[Queued] = deque()
        for queued in self._backlog:
            (dropped if where(queued.batch) else keep).append(queued)
        self._backlog = keep
        return dropped

    async def check(self) -> bool:
        """Ask the engine whether it is up; one that comes back takes its backlog at once."""
        was = self._healthy
        self._healthy = await self.engine.healthy()
        if self._healthy != was:
            log.info("engine %s is %s", self.engine.name, "up" if self._healthy else "down")
            if self._healthy:
                self._wake()
                self._fill()
        return self._healthy

    def _fill(self) -> None:
        while self.free > 0 and self._backlog:
            queued = self._backlog.popleft()
            self._in_flight += 1
            self._start(self, queued)


class EnginePool:
    """Every engine's slot, their health watch, and the wake-up that tells the dispatcher
    capacity freed up (or work arrived)."""

    def __init__(
        self, engines: Sequence[Engine], start: Start, sharing: Sharing | None = None
    ) -> None:
        self._woken = asyncio.Event()
        self._sharing = sharing or Sharing()
        limits = self._sharing.limits
        self.slots = [EngineSlot(e, start, self._woken.set, limits.get(e.name)) for e in engines]
        self._tasks: list[asyncio.Task[None]] = []

    def wake(self) -> None:
        self._woken.set()

    def clear_wake(self) -> None:
        self._woken.clear()

    async def wait_woken(self, timeout_s: float) -> bool:
        """Wait until ``wake`` (True) or ``timeout_s`` (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), timeout_s)
        return self._woken.is_set()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch(), name="engine-health"))
        for slot in self.slots:
            probe = self._sharing.probes.get(slot.engine.name)
            if probe is not None:
                name = f"engine-pressure-{slot.engine.name}"
                self._tasks.append(asyncio.create_task(self._probe(slot, probe), name=name))

    async def _watch(self) -> None:
        while True:
            for slot in self.slots:
                await slot.check()
            healthy = all(s.healthy for s in self.slots)
            await asyncio.sleep(5.0 if healthy else 0.5)

    async def _probe(self, slot: EngineSlot, probe: PressureProbe) -> None:
        """Follow a shared engine's load from its metrics, as often as the settings say
        while they can be read, every few seconds while they cannot; not at all once the
        engine says it has none."""
        while True:
            pressure = await probe.read()
            slot.pressure(pressure)
            if probe.absent:
                log.info(
                    "engine %s publishes no load metrics: its latency is followed", slot.engine.name
                )
                return
            ok = pressure is not None
            await asyncio.sleep(self._sharing.probe_interval_s if ok else _PROBE_RETRY_S)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for slot in self.slots:
            await slot.engine.close()
        for probe in self._sharing.probes.values():
            await probe.close()
