"""Why a running batch makes no progress now, for its owner: the batch object's ``waiting_on``.

Every reason is a fact a worker observed, never a guess: its engines' health checks, the 429s
they answered and the shared-engine governor's limit (``engine_health``: stored with each
engine's report), and the claim's credit gate and fair share as the planner found them
(``scheduling/waits.py``: stored on the batch's lane). This module picks the one to show and
says it in words.

When several hold, the first in ``PRECEDENCE`` is shown: what only the owner can lift before
what lifts by itself, and what stops every line before what stops only some:

1. ``paused``: the owner's own choice comes first;
2. ``credit``: the org's GPU-time work starts nothing until credit is added, whatever the
   engines do;
3. the model's engines, one reason per model (``engine_health.ModelHealth``): an engine that
   is up but held (``rate_limited``, then ``interactive_load``) before one that is starting
   (``engine_starting``) before none answering (``no_healthy_engine``);
4. ``fair_share``: the engines take batch work, and other orgs' fills them;
5. ``priority``: the org's own batches of higher priority (or rescued from missing their
   window) go first.

A batch that has lines running and nothing of the above has no ``waiting_on``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from backfill.domain.engine_health import HeldEngines, Hold, ModelHealth
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import pico_to_usd

if TYPE_CHECKING:
    from backfill.domain.records import BatchRecord


class WaitCode(StrEnum):
    """A ``waiting_on.code``; declared in ``PRECEDENCE`` order."""

    PAUSED = "paused"
    CREDIT = "credit"
    RATE_LIMITED = Hold.RATE_LIMITED.value
    INTERACTIVE_LOAD = Hold.INTERACTIVE_LOAD.value
    ENGINE_STARTING = "engine_starting"
    NO_HEALTHY_ENGINE = "no_healthy_engine"
    FAIR_SHARE = "fair_share"
    PRIORITY = "priority"


# The first that holds is shown.
PRECEDENCE: tuple[WaitCode, ...] = tuple(WaitCode)


@dataclass(frozen=True, slots=True)
class WaitingOn:
    """Why a running batch makes no progress, for its owner: a stable ``code``, a message
    that says what happens next, since when (Unix seconds) and, where a fact gives one, when
    it is expected to move again."""

    code: str
    message: str
    since: int
    resumes_at: int | None = None


@dataclass(frozen=True, slots=True)
class LaneWait:
    """Why the batches of one org on one model (its lane) wait, as the planner last found it;
    stored on the lane and kept while the reason holds."""

    code: WaitCode
    """CREDIT or FAIR_SHARE."""
    since: int
    """The planner pass that first found it (Unix seconds), kept while the code holds."""
    others: int = 0
    """FAIR_SHARE: other orgs with lines running on the model."""
    weight: int = 0
    """FAIR_SHARE: this org's weight."""
    total_weight: int = 0
    """FAIR_SHARE: the weights of every org with work on the model, this one's included."""
    balance: int = 0
    """CREDIT: the org's balance (picodollars, at most 0)."""
    lines: int = 0
    """CREDIT: the lane's lines not finished."""
    needed: int | None = None
    """CREDIT: what those lines cost at the deployment's price and measured pace
    (picodollars); None before the pace was measured."""
    served: int = 0
    """The lane's count of lines ever claimed when it was found."""

    def same(self, other: LaneWait | None) -> bool:
        """Whether ``other`` says the same, ``since`` aside."""
        return other is not None and replace(other, since=self.since) == self

    def holds(self, served: int) -> bool:
        """Whether the wait still holds now that the lane's count of lines ever claimed is
        ``served``: once a claim took one of its lines its batches move, even before the
        planner's next pass clears it."""
        return served <= self.served


@dataclass(frozen=True, slots=True)
class AheadInLane:
    """The org's own batches of the same model that go before a batch with nothing running:
    higher priorities, or batches rescued from missing their window."""

    batches: int
    top_priority: int
    """The highest priority among them."""
    since: int
    """When the last of them started running (Unix seconds)."""
    done_by: int | None
    """When the planner projects the last of them to finish; None when unknown."""


# Only these statuses wait for an engine: a cancelling batch ends without one, a finalizing
# one has no lines left.
_RUNNING = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


def may_wait(batch: BatchRecord) -> bool:
    """Whether ``batch`` could be waiting: it runs and has lines not done."""
    return batch.status in _RUNNING and batch.completed + batch.failed < batch.total


def waiting_on(
    batch: BatchRecord,
    health: Mapping[str, ModelHealth],
    lanes: Mapping[tuple[str, str], LaneWait],
    now: float,
    ahead: AheadInLane | None = None,
) -> WaitingOn | None:
    """Why ``batch`` waits, or None: the first reason of ``PRECEDENCE`` that holds.

    ``health``: each model's engines (``engine_health.model_health``); ``lanes``: the waits
    the planner stored, by (model, org); ``ahead``: the org's batches that go before it, when
    it has nothing running.
    """
    if not may_wait(batch):
        return None
    if batch.paused_at is not None:
        return _paused(batch)
    model = health.get(batch.model)
    # The planner's findings count only while a live worker serves the model: the planner
    # runs in the workers, and the rows it stored outlive them.
    lane = lanes.get((batch.model, batch.org_id)) if model is not None else None
    reasons: tuple[Callable[[], WaitingOn | None], ...] = (
        lambda: _credit(batch, lane) if lane and lane.code == WaitCode.CREDIT else None,
        lambda: _engines(batch, model, now),
        lambda: _fair_share(batch, lane) if lane and lane.code == WaitCode.FAIR_SHARE else None,
        lambda: _priority(batch, ahead) if ahead is not None else None,
    )
    for reason in reasons:
        found = reason()
        if found is not None:
            return found
    return None


def _paused(batch: BatchRecord) -> WaitingOn:
    since = batch.paused_at or batch.created_at
    message = (
        f"The batch was paused at {_utc(since)}: it starts no new request, and those that were "
        f"running finished. Resume it (POST /v1/batches/{batch.id}/resume, or 'backfill batch "
        "resume') and it goes on where it stopped. Its window keeps running while it is paused: "
        f"what is not done by {_utc(batch.expires_at)} expires, and is not charged."
    )
    return WaitingOn(WaitCode.PAUSED, message, since)


def _priority(batch: BatchRecord, ahead: AheadInLane) -> WaitingOn:
    others = f"{ahead.batches:,} other batch{'es' if ahead.batches != 1 else ''}"
    done = f"; they are projected to finish at {_utc(ahead.done_by)}" if ahead.done_by else ""
    message = (
        f"{others} of this organization on model '{batch.model}' {_go(ahead.batches)} first: "
        f"the highest priority among them is {ahead.top_priority}, against this batch's "
        f"{batch.priority} (at the same priority the earlier deadline goes first, and a batch "
        f"about to miss its window goes before all). Its requests start as theirs finish{done}. "
        f'Raise its priority (POST /v1/batches/{batch.id} with {{"priority": N}}) to move it '
        "ahead."
    )
    return WaitingOn(
        WaitCode.PRIORITY,
        message,
        max(batch.in_progress_at or batch.created_at, ahead.since),
        ahead.done_by,
    )


def _credit(batch: BatchRecord, lane: LaneWait) -> WaitingOn:
    short = pico_to_usd(-lane.balance) if lane.balance < 0 else None
    add = f"any amount over ${short}" if short else "any amount"
    cost = ""
    if lane.needed is not None:
        lines = _count(lane.lines, "request")
        cost = (
            f" At the deployment's price and measured pace its {lines} left need about "
            f"${pico_to_usd(lane.needed)} more."
        )
    message = (
        f"Model '{batch.model}' is billed by GPU time, and its requests start only while the "
        f"organization has credit: its balance is ${pico_to_usd(lane.balance)}. Add credit "
        f"({add} brings it above zero) and the batch resumes within seconds, with nothing "
        f"lost; until then it still expires at its expires_at.{cost}"
    )
    return WaitingOn(WaitCode.CREDIT, message, max(batch.created_at, lane.since))


def _fair_share(batch: BatchRecord, lane: LaneWait) -> WaitingOn:
    orgs = _count(lane.others, "other organization")
    percent = 100 * lane.weight / lane.total_weight if lane.total_weight else 100.0
    message = (
        f"The engines of model '{batch.model}' are busy with requests of {orgs}. "
        f"Organizations share them by weight: this one's is {lane.weight} of "
        f"{lane.total_weight} ({percent:.0f}%), and its requests start as theirs end"
        f"{_projected(batch)}."
    )
    return WaitingOn(WaitCode.FAIR_SHARE, message, max(batch.created_at, lane.since))


def _engines(batch: BatchRecord, model: ModelHealth | None, now: float) -> WaitingOn | None:
    """The model's engines' reason: held, starting, or none answering; None when one of them
    takes batch work now."""
    if model is not None and model.held is not None:
        return _held(batch, model.held, now)
    if model is not None and model.starting_since is not None:
        return _starting(batch, model, now)
    if model is not None and model.available:
        return None
    resumes = (
        "Its requests wait in the queue; the batch resumes by itself, with nothing lost or "
        "charged twice, as soon as {when} (it still expires at its expires_at)."
    )
    if model is None or model.down_since is None:
        message = f"No running worker has an engine for model '{batch.model}'. " + resumes.format(
            when="a worker with an engine for it runs"
        )
        return WaitingOn(WaitCode.NO_HEALTHY_ENGINE, message, batch.created_at)
    since = int(model.down_since)
    message = (
        f"No engine serving model '{batch.model}' has passed its health check since "
        f"{_utc(since)}. "
        + resumes.format(when="one answers again")
        + " Operators see why with 'backfill admin engine list'."
    )
    return WaitingOn(WaitCode.NO_HEALTHY_ENGINE, message, since)


def _held(batch: BatchRecord, held: HeldEngines, now: float) -> WaitingOn:
    engines = _engine_names(held.engines)
    since = max(batch.created_at, int(held.since))
    if held.hold == Hold.RATE_LIMITED:
        status = {429: "429 Too Many Requests", 503: "503 Service Unavailable"}.get(
            held.status or 429, f"{held.status}"
        )
        # A retry time already past (a report stored a moment ago) promises nothing.
        until = math.ceil(held.until) if held.until is not None and held.until > now else None
        next_try = f", the next at about {_utc(until)}" if until is not None else ""
        message = (
            f"{engines} serving model '{batch.model}' answered Backfill with {status} since "
            f"{_utc(int(held.since))}: the engine is limiting the requests it takes. They are "
            f"retried after its Retry-After or a backoff{next_try}, with nothing lost or "
            "charged twice, and the batch moves on as soon as one succeeds."
        )
        return WaitingOn(WaitCode.RATE_LIMITED, message, since, until)
    people = _count(round(held.people), "request")
    message = (
        f"{engines} serving model '{batch.model}' {_is_are(held.engines)} shared with "
        f"interactive traffic and full of it ({people} of people running or waiting): batch "
        "work takes only what people leave. The batch's requests start as soon as they leave "
        f"room, with nothing lost{_projected(batch)}."
    )
    return WaitingOn(WaitCode.INTERACTIVE_LOAD, message, since)


def _starting(batch: BatchRecord, model: ModelHealth, now: float) -> WaitingOn:
    took = f"; its last start took about {model.start_s:.0f} s" if model.start_s is not None else ""
    message = (
        f"The engine for model '{batch.model}' runs on demand and is being started{took}. "
        "The batch's requests run as soon as it answers."
    )
    started = model.starting_since or 0.0
    since = max(batch.created_at, int(started))
    # Expected when its learnt start has passed since it began starting; not once overdue.
    ready = started + model.start_s if model.start_s is not None else None
    resumes = math.ceil(ready) if ready is not None and ready > now else None
    return WaitingOn(WaitCode.ENGINE_STARTING, message, since, resumes)


def _projected(batch: BatchRecord) -> str:
    """The planner's projection of the batch's end, which counts this wait, when it has one."""
    end = batch.estimated_completion_at
    if end is None or batch.status != BatchStatus.IN_PROGRESS:
        return ""
    return f"; at this pace it is projected to finish at {_utc(end)} (estimated_completion_at)"


def _engine_names(names: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{name}'" for name in names)
    return f"Engine {quoted}" if len(names) == 1 else f"Engines {quoted}"


def _go(n: int) -> str:
    return "goes" if n == 1 else "go"


def _is_are(names: tuple[str, ...]) -> str:
    return "is" if len(names) == 1 else "are"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _utc(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
