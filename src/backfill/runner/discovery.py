"""Replicas found by name (docs/fleet.md): each engine entry with ``discovery`` is looked up
every ``discovery_interval_s``, and the pool follows what the name says now.

- An address that appears is a replica that joined: its engine is added to the pool, and
  gets work once a health check finds it up.
- An address that is gone is a replica that left: its engine is retired (no new work; its
  claimed backlog goes back to the queue; its requests in flight end there, or fail and are
  retried on another replica, uncharged), then removed.
- A lookup that fails changes nothing: a nameserver that does not answer for a while must
  not take a fleet away. A name with no address left is a fleet scaled to zero.

Replicas of one entry serve the same models, so they claim as one replica group and lines
are sent where their prompt prefix hashes (``domain/scheduling/locality.py``): rendezvous
hashing moves only the prefixes of a replica that leaves, and about one in n to one that
joins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from backfill.domain.scheduling.concurrency import ConcurrencyLimit
from backfill.ports import DiscoveryFailed, Engine, PressureProbe, PriorityProbe, ReplicaFinder
from backfill.runner.engine_pool import EnginePool
from backfill.runner.slots import EngineSlot

log = logging.getLogger("backfill.runner")


@dataclass(frozen=True, slots=True)
class Replica:
    """What one found replica runs with: the engine that calls it, its limit and probes."""

    engine: Engine
    limit: ConcurrencyLimit
    probe: PressureProbe | None = None
    priority: PriorityProbe | None = None


@dataclass(frozen=True, slots=True)
class DiscoveredEngine:
    """An engine entry whose replicas are found by name; ``build`` makes the replica at an
    address (named with ``replica_name``)."""

    name: str
    models: tuple[str, ...]
    finder: ReplicaFinder
    interval_s: float
    build: Callable[[str, int], Replica]


def replica_name(entry: str, address: str, port: int) -> str:
    """How a replica is named in engine health, metrics and logs: ``entry@address:port``."""
    host = f"[{address}]" if ":" in address else address
    return f"{entry}@{host}:{port}"


class ReplicaSet:
    """One entry's replicas in the pool, following its lookups."""

    def __init__(self, pool: EnginePool, entry: DiscoveredEngine) -> None:
        self._pool = pool
        self.entry = entry
        self.known: frozenset[tuple[str, int]] = frozenset()
        # This set's own replicas, by name: one that left and comes back while still
        # draining goes on in the same slot. A slot of an earlier set (the entry changed) is
        # never revived: it has the old settings.
        self._slots: dict[str, EngineSlot] = {}
        self._failing = False
        self._looked_up = False

    async def look_up(self) -> None:
        """Look the name up once and add or retire the replicas that joined or left."""
        entry = self.entry
        try:
            found = await entry.finder.find()
        except DiscoveryFailed as exc:
            if not self._failing:
                log.warning(
                    "engine %s: %s; its %d known replicas stay until a lookup answers",
                    entry.name,
                    exc,
                    len(self.known),
                )
            self._failing = True
            return
        if self._failing:
            log.info("engine %s: %s answers again", entry.name, entry.finder.name)
        self._failing = False
        for address, port in sorted(found - self.known):
            name = replica_name(entry.name, address, port)
            # Back before the requests it had when it left ended: the same slot goes on.
            slot = self._slots.get(name)
            if slot is None or not self._pool.revive(slot):
                replica = entry.build(address, port)
                self._slots[name] = self._pool.add(
                    replica.engine, replica.limit, replica.probe, replica.priority
                )
            log.info("engine %s: replica %s joined", entry.name, name)
        for address, port in sorted(self.known - found):
            name = replica_name(entry.name, address, port)
            self._pool.retire(name)
            log.info("engine %s: replica %s left; it takes no new work", entry.name, name)
        if not found and (self.known or not self._looked_up):
            log.warning(
                "engine %s: %s has no address: no replica serves %s until one appears",
                entry.name,
                entry.finder.name,
                ", ".join(entry.models),
            )
        self.known = found
        self._looked_up = True

    def leave_all(self) -> None:
        """The entry itself is gone (removed, disabled or changed): every replica leaves."""
        for address, port in sorted(self.known):
            self._pool.retire(replica_name(self.entry.name, address, port))
        self.known = frozenset()
