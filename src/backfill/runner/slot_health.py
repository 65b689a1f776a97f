"""What one engine's health checks found, and what of it is logged: a warning with the reason
when the engine is down, again every ``remind_s`` while it stays down, a flapping engine's
outages at most that often (``HealthTracker`` decides; ``log_line`` words it)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from backfill.domain.engine_health import EngineState, HealthTracker, log_line
from backfill.ports import Clock, Engine, EngineDiagnostics

log = logging.getLogger("backfill.runner")


class SlotHealth:
    def __init__(
        self, engine: Engine, clock: Clock, remind_s: float, changed: Callable[[], None]
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._changed = changed
        self.tracker = HealthTracker(clock.now(), remind_s=remind_s)
        self.healthy = False
        # When (monotonic) the engine last answered one of Backfill's requests with a 200.
        self._answered_at: float | None = None

    @property
    def url(self) -> str | None:
        engine = self._engine
        return engine.url if isinstance(engine, EngineDiagnostics) else None

    @property
    def error(self) -> str | None:
        """Why the engine's last health check failed, as it says (None: it does not say)."""
        engine = self._engine
        return engine.health_error if isinstance(engine, EngineDiagnostics) else None

    def answered(self, at: float) -> None:
        self._answered_at = at

    def answered_within(self, seconds: float) -> bool:
        answered = self._answered_at
        return answered is not None and self._clock.monotonic() - answered < seconds

    def observe(self, state: EngineState, reason: str | None = None) -> bool:
        """Note what a check found; whether the engine just came up."""
        seen = self.tracker.observe(state, reason, self._clock.now())
        if seen.note is not None:
            engine = self._engine
            line = log_line(
                seen.note,
                engine=engine.name,
                url=self.url,
                models=engine.models,
                reason=self.tracker.reason,
            )
            log.log(logging.WARNING if line.warning else logging.INFO, "%s", line.text)
        was, self.healthy = self.healthy, state == EngineState.UP
        if seen.changed:
            self._changed()
        return self.healthy and not was
