"""Dispatch: claim work for each engine that wants it and hand it to the engine's slot.

The claim chooses what runs next (fair across orgs, earliest deadline first), so the worker
never lists batches. Orgs whose GPU-time work waits for credit (SPEC §7.4) start nothing.
Replicas (engines serving the same models) claim together, and each line goes to the replica
its prompt prefix hashes to (``domain/scheduling/locality.py``), lines of one prefix back to back.
A line with remote images fetches them in the fetch pool before it is queued for its slot.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from opentelemetry.util.types import AttributeValue

from backfill.domain.catalog import Billing
from backfill.domain.input_format import request_body
from backfill.domain.media import may_hold_remote_images, remote_image_urls
from backfill.domain.records import Claim, WorkBatch
from backfill.domain.scheduling.locality import assign, prefix_key
from backfill.ports import BlobStore, Clock, LedgerStore, WorkQueue
from backfill.runner.engine_pool import EnginePool
from backfill.runner.inputs import ClaimInput, Queued
from backfill.runner.leases import Leases
from backfill.runner.loops import Pace
from backfill.runner.slots import EngineSlot
from backfill.runner.spans import span_since

# A line the full fetch pool turned away is claimable again after this long. At once, the next
# claim (for a line of another org, say) would bring it back to be turned away again, each
# time a write, while the pool stays full.
TURNED_AWAY_S = 1.0


class FetchFirst(Protocol):
    """Fetches a request's remote images holding no engine slot, then hands it to ``then``;
    False when there is no room to (``RequestRunner.fetch_first``)."""

    def __call__(
        self,
        slot: EngineSlot,
        queued: Queued,
        body: dict[str, Any],
        then: Callable[[Queued], None],
    ) -> bool: ...


class Dispatcher:
    def __init__(
        self,
        queue: WorkQueue,
        ledger: LedgerStore,
        blobs: BlobStore,
        pool: EnginePool,
        leases: Leases,
        clock: Clock,
        *,
        poll_interval_s: float,
        gather_s: float,
        idle_poll_s: float | None = None,
        locality: bool = True,
        fetch_first: FetchFirst | None = None,
    ) -> None:
        """``fetch_first``: where lines with remote images go before their slot (without it,
        they are queued for their slot like the others)."""
        self._fetch_first = fetch_first
        self._queue = queue
        self._ledger = ledger
        self._blobs = blobs
        self._pool = pool
        self._leases = leases
        self._clock = clock
        # Claims that find nothing are made less and less often, up to ``idle_poll_s`` apart:
        # work this process makes wakes the pool, so only another process's is waited for.
        base_s = poll_interval_s * 4
        self._pace = Pace(base_s, base_s if idle_poll_s is None else idle_poll_s)
        self._asked = False
        self._gather_s = gather_s
        self._paused: set[str] = set()
        self._locality = locality

    def _groups(self) -> list[list[EngineSlot]]:
        """Engines that serve the same models are replicas: they claim as one when locality
        is on, each on its own otherwise (round robin, in effect). Found at every claim, as
        replicas join and leave."""
        groups: dict[tuple[str, ...], list[EngineSlot]] = {}
        for n, slot in enumerate(self._pool.slots):
            if slot.retired:
                continue
            key = tuple(sorted(slot.engine.models)) if self._locality else (str(n),)
            groups.setdefault(key, []).append(slot)
        return list(groups.values())

    async def round(self) -> None:
        """Claim once; when nothing was claimed, wait for capacity or new work (or a poll)."""
        self._pool.clear_wake()
        self._asked = False
        if await self.dispatch_once():
            self._pace.found(True)
            return
        if self._asked:
            self._pace.found(False)  # the queue had nothing: ask it less often
            wait_s = self._pace.wait_s
        else:
            # Every engine is full: only a slot that frees up (which wakes the pool) lets
            # this worker take more.
            wait_s = self._pace.idle_s
        if await self._pool.wait_woken(wait_s):
            # Let slots that free up together be refilled by one claim, not one each.
            await asyncio.sleep(self._gather_s)

    async def dispatch_once(self) -> int:
        """Claim for each engine that wants work; how many requests were claimed.

        A few more items than free slots are claimed into the slot's backlog, so a request that
        ends is followed at once by the next, without waiting for a claim round trip.
        """
        if self._paused:
            # Credit added since lets a paused org run again (claims already skip an org
            # without credit; this set drops what was claimed before its credit ran out).
            balances = await self._ledger.balances(sorted(self._paused))
            self._paused = {org for org, balance in balances.items() if balance <= 0}
        # Claimed for an engine gone down or away since: back to the queue, for a replica
        # that is up.
        gone = [s for s in self._pool.slots if not s.healthy or s.retired]
        self._drop(lambda _batch: True, gone)
        await self._pool.reap()
        claimed = 0
        for slots in self._groups():
            if len(slots) == 1:
                claimed += await self._claim_for(slots[0])
            else:
                claimed += await self._claim_for_replicas(slots)
        return claimed

    async def _claim(
        self, slots: Sequence[EngineSlot], models: Sequence[str], wanted: int
    ) -> list[Queued]:
        """Lease up to ``wanted`` lines of these models for ``slots``, less those of paused
        orgs."""
        now = self._clock.now()
        leases = self._leases
        self._asked = True
        # Spans are dated by the wall clock, which a test's manual Clock would not follow.
        started_ns = time.time_ns()
        claims = await self._queue.claim(models, wanted, leases.token, now + leases.lease_s, now)
        if claims:
            span_since("worker.claim", started_ns, lambda: _claimed(slots, models, wanted, claims))
        queued: list[Queued] = []
        for claim in claims:
            read = ClaimInput(self._blobs, claim)
            queued += (Queued(claim.batch, item, read) for item in claim.items)
        if self._paused:
            leases.release_soon(q for q in queued if self._is_paused(q.batch))
            queued = [q for q in queued if not self._is_paused(q.batch)]
        return queued

    async def _claim_for(self, slot: EngineSlot) -> int:
        if slot.wanted < slot.claim_threshold:
            return 0
        queued = await self._claim([slot], slot.engine.models, slot.wanted)
        if self._fetch_first is None:
            slot.offer(queued)
            return len(queued)
        return self._hand_over(slot, queued, await _lines(queued))

    def _hand_over(self, slot: EngineSlot, queued: list[Queued], lines: list[bytes]) -> int:
        """Queue claimed requests for their slot, those whose lines hold remote images once
        the fetch pool has fetched them; how many this worker kept. A request the full pool
        turns away goes back to the queue for ``TURNED_AWAY_S``, and is not counted: it
        found nothing to do here. The pool wakes the dispatcher when it has room again."""
        fetch_first = self._fetch_first
        ready: list[Queued] = []
        turned_away: list[Queued] = []
        for q, line in zip(queued, lines, strict=True):
            if fetch_first is None or not line:
                ready.append(q)  # a line not read: its request meets the failure
                continue
            try:
                body = request_body(line)
            except Exception:
                ready.append(q)  # its request meets the failure and handles it
                continue
            # Read and decoded once, here: the request takes its body to the slot.
            if not may_hold_remote_images(line) or not remote_image_urls(body):
                ready.append(Queued(q.batch, q.item, q.input, body))
            elif not fetch_first(slot, q, body, functools.partial(self._fetched, slot)):
                turned_away.append(q)
        if turned_away:
            self._leases.release_soon(turned_away, self._clock.now() + TURNED_AWAY_S)
            slot.wake_in(TURNED_AWAY_S)
        slot.offer(ready)
        return len(queued) - len(turned_away)

    def _fetched(self, slot: EngineSlot, queued: Queued) -> None:
        """A request whose images were fetched goes ahead of its slot's backlog, unless its
        org was paused meanwhile or its engine left the fleet (a retired slot may be removed
        already): then its lease goes back like the backlog's."""
        if self._is_paused(queued.batch) or slot.retired:
            self._leases.release_soon([queued])
        else:
            slot.offer_first(queued)

    async def _claim_for_replicas(self, slots: list[EngineSlot]) -> int:
        """One claim for replicas of the same models, each line sent where its prefix goes."""
        wanted = [slot.wanted for slot in slots]
        if sum(wanted) < min(slot.claim_threshold for slot in slots):
            return 0
        queued = await self._claim(slots, slots[0].engine.models, sum(wanted))
        lines = await _lines(queued)
        keys = [prefix_key(line) for line in lines]
        ordered = sorted(zip(keys, queued, lines, strict=True), key=lambda triple: triple[0])
        # A replica may take up to one more prefetch's worth than it wants, so a prefix is
        # not sent elsewhere (and missed in its cache) for want of one slot this round; its
        # backlog stays bounded, and the others claim again as soon as they want more.
        # None for a replica down or taking nothing now: lines would only wait in its backlog.
        ok = [s.healthy and s.limit > 0 for s in slots]
        room = [w + s.prefetch if k else 0 for w, s, k in zip(wanted, slots, ok, strict=True)]
        picks = assign([k for k, _, _ in ordered], [s.engine.name for s in slots], room)
        shares: list[list[tuple[Queued, bytes]]] = [[] for _ in slots]
        for pick, (_, q, line) in zip(picks, ordered, strict=True):
            shares[pick].append((q, line))
        kept = 0
        for slot, share in zip(slots, shares, strict=True):
            kept += self._hand_over(slot, [q for q, _ in share], [line for _, line in share])
        return kept

    def wake(self) -> None:
        """Claim now: lines just went back to the queue."""
        self._pool.wake()

    def pause(self, orgs: Iterable[str]) -> None:
        """Start no more GPU-time work of these orgs until a balance check finds credit."""
        self._paused |= set(orgs)
        self._drop(self._is_paused)

    def stop_starting(self, batch_id: str) -> None:
        """Start nothing more of this batch (it is cancelled or expired)."""
        self._drop(lambda batch: batch.id == batch_id)

    def drop_all(self) -> None:
        self._drop(lambda _batch: True)

    def _is_paused(self, batch: WorkBatch) -> bool:
        return batch.billing == Billing.GPU_TIME and batch.org_id in self._paused

    def _drop(
        self, where: Callable[[WorkBatch], bool], slots: Sequence[EngineSlot] | None = None
    ) -> None:
        """Give back claimed, unstarted items of batches that must not start more work."""
        for slot in self._pool.slots if slots is None else slots:
            self._leases.release_soon(slot.drop(where))


async def _lines(queued: Sequence[Queued]) -> list[bytes]:
    """Each request's line; b"" for one that cannot be read yet (its request meets the
    failure again and handles it like any other). Its request needs it next anyway, and a
    claim's lines are one read, started for every claim before any is waited for."""
    for q in queued:
        q.input.read_soon()
    lines: list[bytes] = []
    for q in queued:
        try:
            lines.append(await q.input.line(q.item))
        except Exception:
            lines.append(b"")
    return lines


def _claimed(
    slots: Sequence[EngineSlot], models: Sequence[str], wanted: int, claims: Sequence[Claim]
) -> dict[str, AttributeValue]:
    """What a claim span tells: for which engines and models, how many lines were asked for
    and leased, of which batches."""
    return {
        "backfill.engines": [slot.engine.name for slot in slots],
        "backfill.models": list(models),
        "backfill.wanted": wanted,
        "backfill.lines": sum(len(claim.items) for claim in claims),
        "backfill.batch_ids": sorted({claim.batch.id for claim in claims}),
    }
