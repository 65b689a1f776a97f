"""Any engine with a command started on demand: it is "starting", not down, until it answers;
the time that takes is learnt and reported; each engine stops after its own idle time."""

from __future__ import annotations

from backfill.domain.engine_health import EngineState
from backfill.runner.on_demand import OnDemand
from backfill.runner.slots import START_LIMIT_S, EngineSlot
from tests.unit.test_embedding_engine import EMBED, Setup


def state(slot: EngineSlot) -> EngineState | None:
    return slot.health.state


class Loading(Setup):
    """The embedding engine's process answers only once ``loaded``."""

    def __init__(self, idle_stop_s: float = 30.0) -> None:
        super().__init__()
        self.loaded = False
        ask = self.embed.healthy

        async def healthy() -> bool:
            return self.loaded and await ask()

        self.embed.healthy = healthy  # type: ignore[method-assign]
        self.on_demand = OnDemand(
            self.pool, self.queue, clock=self.clock, idle_stop_s={"embed": idle_stop_s}
        )

    async def start_taking(self, seconds: float) -> None:
        self.queue.ready = {EMBED}
        await self.on_demand.step()
        assert state(self.slot) == EngineState.STARTING
        for _ in range(int(seconds)):
            self.clock.advance(1.0)
            assert not await self.slot.check()
            assert state(self.slot) == EngineState.STARTING, "starting is not down"
        self.loaded = True
        assert await self.slot.check()


async def test_a_start_is_starting_until_it_answers_and_its_length_is_learnt() -> None:
    s = Loading()
    assert s.slot.start_s is None
    await s.start_taking(8)
    assert state(s.slot) == EngineState.UP
    assert s.slot.start_s == 8.0
    # Stopped after its own idle time (30 s here, not the default 600 s), then a slower start:
    # the learnt time moves halfway towards it.
    s.queue.ready = set()
    s.loaded = False
    s.clock.advance(31.0)
    await s.on_demand.step()
    assert s.switch.stops == 1
    assert state(s.slot) == EngineState.STANDBY
    await s.start_taking(12)
    assert s.slot.start_s == 10.0


async def test_a_start_that_never_answers_is_down_after_the_limit() -> None:
    s = Loading()
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    s.clock.advance(START_LIMIT_S - 1)
    await s.slot.check()
    assert state(s.slot) == EngineState.STARTING
    s.clock.advance(1.0)
    await s.slot.check()
    assert state(s.slot) == EngineState.DOWN
    assert s.slot.start_s is None, "a start that failed teaches nothing"
