"""One claim, as a reference model: which chunks and lines a claim takes, and where each lane
stands after it.

The database's claim (``adapters/db/claims.py``) is the fast path of these rules, pinned to
this model by ``tests/contract/test_claim_model.py`` on SQLite and PostgreSQL. Each rule is
written here once; the adapter uses the same pieces where it computes in Python (the turn
key, the virtual-time step, the credit gate of the planner's reads, the level of a lane that
reopens), and its SQL orders by the same tuples of columns its indexes hold.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from backfill.domain.scheduling.fair_share import LaneTurn, split_claim, vtime_step
from backfill.domain.scheduling.planning import NOT_URGENT

# Chunks (one per lane) a claim takes lines from: claims stay large however many orgs wait.
LANES_PER_CLAIM = 4
# Lanes looked at per claim: a lane whose every chunk waits (a backoff, a batch just stopped)
# is passed over; locks are taken only on the chunks a claim returns.
LANES_LOOKED_AT = 4 * LANES_PER_CLAIM
# The lanes' turn, as lane fields (and columns): urgent lanes first by deadline, then the
# least virtual time. ``ix_lanes_turn`` holds the first two after the model; the org and the
# model only break ties, so that every claimer orders lanes alike.
TURN_ORDER = ("urgent_by", "vtime", "org_id", "model")
INDEXED_TURN = TURN_ORDER[:2]
# A lane's chunks: by rank (a rescued batch first, then higher priorities; domain/priority.py),
# then earliest deadline first (``ix_chunks_ready`` after the model and org).
CHUNK_ORDER = ("rank", "expires_at", "batch_id", "chunk")


class ChunkState(IntEnum):
    """A chunk's state (a small int per row)."""

    READY = 0
    """It holds queued lines."""
    TAKEN = 1
    """All its lines are leased or done."""
    PAUSED = 2
    """Its batch is paused and it holds queued lines: no claim sees it, its lane does not
    count it."""


def turn_key(lane: Any) -> tuple[Any, ...]:
    """Where ``lane`` (anything with the ``TURN_ORDER`` fields) stands in the turn."""
    return tuple(getattr(lane, name) for name in TURN_ORDER)


def has_claimable_work(ready: int, metered: bool, balance: int) -> bool:
    """The credit gate: a lane with ready chunks may be claimed, unless it is a GPU-time lane
    of an org without credit (SPEC §7.4), which waits and so is not waiting work either."""
    return ready > 0 and (not metered or balance > 0)


def level_on_reopen(vtime: float, ready: int, least_busy: float | None) -> float:
    """A lane's virtual time when a batch of it starts. An idle lane (no ready chunk) starts
    level with ``least_busy``, the least virtual time of its model's lanes with ready work,
    from below or from above: it neither takes a burst to catch up nor waits for the others
    to pass its own history. A busy lane, or one with no busy lane beside it, keeps its own."""
    return least_busy if ready == 0 and least_busy is not None else vtime


def lane_turn(vtime: float, weight: int, urgent_by: int, room: int) -> LaneTurn:
    """A picked lane as the split sees it; ``room`` is its chunk's length."""
    return LaneTurn(vtime=vtime, weight=weight, urgent=urgent_by < NOT_URGENT, room=room)


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A chunk of a lane; ``chunk`` is its first line's index."""

    batch_id: str
    chunk: int
    end_idx: int
    expires_at: int
    queued: Mapping[int, float | None]
    """Its queued lines' indexes, each with the time before which it may not go (or None)."""
    state: ChunkState = ChunkState.READY
    not_before: float | None = None
    rank: int = 0
    running: bool = True
    """Its batch is in progress."""

    def open_at(self, now: float) -> bool:
        """A claim may take it at ``now``: ready, its batch running and not expired, its
        backoff over."""
        return (
            self.state == ChunkState.READY
            and self.running
            and self.expires_at > now
            and (self.not_before is None or self.not_before <= now)
        )

    def lines(self, now: float, limit: int) -> tuple[int, ...]:
        """The lines a lease of ``limit`` takes: queued ones free to go, in index order."""
        free = sorted(i for i, nb in self.queued.items() if nb is None or nb <= now)
        return tuple(free[:limit])


@dataclass(frozen=True, slots=True)
class LaneView:
    model: str
    org_id: str
    weight: int
    vtime: float
    ready: int
    """The lane's count of ready chunks."""
    metered: bool = False
    urgent_by: int = NOT_URGENT
    chunks: tuple[ChunkView, ...] = ()


def least_busy(lanes: Sequence[LaneView], model: str) -> float | None:
    """The level a lane of ``model`` that reopens starts at (``level_on_reopen``): the least
    virtual time of the model's lanes with ready chunks, with credit or without."""
    return min(
        (lane.vtime for lane in lanes if lane.model == model and lane.ready > 0), default=None
    )


@dataclass(frozen=True, slots=True)
class Pick:
    model: str
    org_id: str
    batch_id: str
    chunk: int
    lines: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    picks: tuple[Pick, ...]
    """The chunks a claim leases lines of, in turn order (none with no line)."""
    vtimes: dict[tuple[str, str], float]
    """Every lane's virtual time after the claim, by (model, org)."""


def turn(
    lanes: Sequence[LaneView], balances: Mapping[str, int], models: Collection[str], now: float
) -> list[tuple[LaneView, ChunkView]]:
    """The lanes whose turn it is, each with its first open chunk (``CHUNK_ORDER``): of the first
    ``LANES_LOOKED_AT`` claimable lanes in turn order, the first ``LANES_PER_CLAIM`` that have
    one."""
    waiting = sorted(
        (
            lane
            for lane in lanes
            if lane.model in models
            and has_claimable_work(lane.ready, lane.metered, balances.get(lane.org_id, 0))
        ),
        key=turn_key,
    )
    picked: list[tuple[LaneView, ChunkView]] = []
    for lane in waiting[:LANES_LOOKED_AT]:
        open_chunks = [c for c in lane.chunks if c.open_at(now)]
        if open_chunks:
            first = min(open_chunks, key=lambda c: tuple(getattr(c, n) for n in CHUNK_ORDER))
            picked.append((lane, first))
    return picked[:LANES_PER_CLAIM]


def claim(
    lanes: Sequence[LaneView],
    balances: Mapping[str, int],
    models: Collection[str],
    limit: int,
    now: float,
) -> ClaimOutcome:
    """A claim of up to ``limit`` lines for an engine serving ``models``: the lanes whose turn
    it is split the lines by weighted fair share (``split_claim``, urgent lanes first); each
    leases what its chunk holds of its share, and its virtual time grows by what it leased
    over its weight."""
    vtimes = {(lane.model, lane.org_id): lane.vtime for lane in lanes}
    if limit <= 0:
        return ClaimOutcome((), vtimes)
    picked = turn(lanes, balances, models, now)
    shares = split_claim(
        limit,
        [
            lane_turn(lane.vtime, lane.weight, lane.urgent_by, chunk.end_idx - chunk.chunk)
            for lane, chunk in picked
        ],
    )
    picks: list[Pick] = []
    for (lane, chunk), share in zip(picked, shares, strict=True):
        lines = chunk.lines(now, share)
        if lines:
            picks.append(Pick(lane.model, lane.org_id, chunk.batch_id, chunk.chunk, lines))
        vtimes[(lane.model, lane.org_id)] += vtime_step(len(lines), lane.weight)
    return ClaimOutcome(tuple(picks), vtimes)
