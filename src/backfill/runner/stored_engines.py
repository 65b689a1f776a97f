"""The engines stored for every worker to serve (docs/fleet.md), followed while the worker runs.

At start the worker seeds the table from its config file (``EngineAdmin.seed``), then serves
what is stored, and looks again every ``engine_config_poll_s``:

- an engine that appears (added through the admin API, or by another worker's file) is added
  to the pool, and gets work once a health check finds it up;
- an engine removed or disabled is retired: no new work, its claimed backlog goes back to the
  queue, what runs there finishes, then it is gone;
- an engine whose settings changed is retired and added again under the same name: new
  requests follow the new settings at once, requests running finish under the old;
- an engine whose replicas are found by name (``discovery``) is looked up as its
  ``discovery_interval_s`` says (``discovery.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from backfill.domain.engine_config import StoredEngine
from backfill.ports import Clock
from backfill.runner.discovery import DiscoveredEngine, Replica, ReplicaSet
from backfill.runner.engine_pool import EnginePool
from backfill.services.engine_admin import EngineAdmin
from backfill.settings import EngineSettings

log = logging.getLogger("backfill.runner")

Build = Callable[[EngineSettings], Replica | DiscoveredEngine]
"""The engine (or the replicas found by name) that an engine's settings describe."""


@dataclass(slots=True)
class _Served:
    fingerprint: tuple[str, bytes | None, bool]
    replicas: ReplicaSet | None = None
    next_lookup: float = 0.0


class StoredEngines:
    def __init__(
        self,
        pool: EnginePool,
        admin: EngineAdmin,
        build: Build,
        clock: Clock,
        *,
        poll_s: float,
        file: Sequence[EngineSettings] = (),
    ) -> None:
        self._pool = pool
        self._admin = admin
        self._build = build
        self._clock = clock
        self._poll_s = poll_s
        self._file = list(file)
        self._served: dict[str, _Served] = {}
        # Engines whose stored settings could not be built, by fingerprint: said once.
        self._refused: set[tuple[str, bytes | None, bool]] = set()
        # The last look at the table failed: said once until one succeeds.
        self._failing = False

    async def start(self) -> None:
        """Seed the table from the config file, then serve what is stored."""
        await self._admin.seed(self._file)
        await self.follow()

    async def step(self) -> float:
        """Follow the table once; seconds until the next look."""
        try:
            await self.follow()
        except Exception as exc:  # the database may be down: serve what is known meanwhile
            if not self._failing:
                log.warning(
                    "could not read the stored engines (%s); serving those known, trying again",
                    type(exc).__name__,
                )
            self._failing = True
        else:
            if self._failing:
                log.info("the stored engines can be read again")
            self._failing = False
        return self._wait_s()

    async def follow(self) -> None:
        stored = {e.name: e for e in await self._admin.all() if e.enabled}
        for name, served in list(self._served.items()):
            engine = stored.get(name)
            if engine is None or engine.fingerprint() != served.fingerprint:
                self._let_go(name, served)
                del self._served[name]
                if engine is None:
                    log.info("engine %s removed or disabled: it takes no new work", name)
        for name, engine in stored.items():
            if name not in self._served:
                await self._serve(engine)
        now = self._clock.monotonic()
        for served in self._served.values():
            replicas = served.replicas
            if replicas is not None and now >= served.next_lookup:
                await replicas.look_up()
                served.next_lookup = now + replicas.entry.interval_s

    async def _serve(self, engine: StoredEngine) -> None:
        fingerprint = engine.fingerprint()
        try:
            built = self._build(self._admin.settings(engine))
        except Exception as exc:  # stored by an older release, or a key sealed elsewhere
            if fingerprint not in self._refused:
                # The error's kind and first message only: a validation error's full text
                # repeats its input, which holds the decrypted api_key.
                log.warning("engine %s as stored cannot be served: %s", engine.name, _reason(exc))
                self._refused.add(fingerprint)
            return
        if isinstance(built, DiscoveredEngine):
            served = _Served(fingerprint, ReplicaSet(self._pool, built))
        else:
            try:
                self._pool.add(built.engine, built.limit, built.probe, built.priority)
            except ValueError:
                # The name is this process's own engine (one with a command, or the local
                # one): that one goes on, the stored one is not served here.
                if fingerprint not in self._refused:
                    log.warning(
                        "engine %s as stored is not served by this worker: an engine of its "
                        "own has that name; rename one of them",
                        engine.name,
                    )
                    self._refused.add(fingerprint)
                return
            served = _Served(fingerprint)
        self._served[engine.name] = served

    def _let_go(self, name: str, served: _Served) -> None:
        if served.replicas is not None:
            served.replicas.leave_all()
        else:
            self._pool.retire(name)

    def _wait_s(self) -> float:
        now = self._clock.monotonic()
        due = [s.next_lookup - now for s in self._served.values() if s.replicas is not None]
        return max(0.05, min([self._poll_s, *due]))


def _reason(exc: Exception) -> str:
    """What is wrong, without the input that was refused."""
    if isinstance(exc, ValidationError):
        first = exc.errors(include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "engine"
        return f"{where}: {first['msg']}"
    return type(exc).__name__
