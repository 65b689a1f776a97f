"""The reference model of one claim: the turn, the earliest-deadline chunk of each lane, the
credit gate, the weighted split, the virtual-time step, and the level of a lane that reopens."""

from __future__ import annotations

from backfill.domain.scheduling.claim_model import (
    LANES_LOOKED_AT,
    LANES_PER_CLAIM,
    ChunkState,
    ChunkView,
    LaneView,
    claim,
    has_claimable_work,
    least_busy,
    level_on_reopen,
    turn,
    turn_key,
)
from backfill.domain.scheduling.planning import NOT_URGENT

NOW = 1000.0


def chunk(
    batch: str = "b",
    first: int = 0,
    lines: int = 8,
    expires: int = 2000,
    *,
    queued: dict[int, float | None] | None = None,
    state: ChunkState = ChunkState.READY,
    not_before: float | None = None,
    running: bool = True,
) -> ChunkView:
    return ChunkView(
        batch_id=batch,
        chunk=first,
        end_idx=first + lines,
        expires_at=expires,
        queued={i: None for i in range(first, first + lines)} if queued is None else queued,
        state=state,
        not_before=not_before,
        running=running,
    )


def lane(
    org: str,
    *chunks: ChunkView,
    model: str = "m",
    weight: int = 1,
    vtime: float = 0.0,
    ready: int | None = None,
    metered: bool = False,
    urgent_by: int = NOT_URGENT,
) -> LaneView:
    held = chunks or (chunk(f"b-{org}"),)
    return LaneView(
        model=model,
        org_id=org,
        weight=weight,
        vtime=vtime,
        ready=len(held) if ready is None else ready,
        metered=metered,
        urgent_by=urgent_by,
        chunks=held,
    )


def orgs_in_turn(lanes: list[LaneView], balances: dict[str, int] | None = None) -> list[str]:
    return [one.org_id for one, _ in turn(lanes, balances or {}, {"m"}, NOW)]


def test_urgent_lanes_come_first_by_deadline_then_the_least_virtual_time() -> None:
    lanes = [
        lane("a", vtime=0.0),
        lane("b", vtime=5.0, urgent_by=1500),
        lane("c", vtime=9.0, urgent_by=1200),
        lane("d", vtime=-1.0),
    ]
    assert orgs_in_turn(lanes) == ["c", "b", "d", "a"]


def test_ties_go_to_the_org_then_the_model() -> None:
    lanes = [lane("b"), lane("a", model="n"), lane("a", model="m")]
    assert sorted(lanes, key=turn_key) == [lanes[2], lanes[1], lanes[0]]
    assert turn_key(lanes[0]) == (NOT_URGENT, 0.0, "b", "m")


def test_a_gpu_time_lane_of_an_org_without_credit_waits() -> None:
    assert has_claimable_work(ready=1, metered=False, balance=0)
    assert has_claimable_work(ready=1, metered=True, balance=1)
    assert not has_claimable_work(ready=1, metered=True, balance=0)
    assert not has_claimable_work(ready=0, metered=False, balance=5)
    lanes = [lane("a", metered=True), lane("b", metered=True)]
    assert orgs_in_turn(lanes, {"b": 1}) == ["b"]


def test_each_lane_gives_its_earliest_deadline_open_chunk() -> None:
    late, early = chunk("b1", expires=1900), chunk("b2", expires=1800)
    tie_first, tie_second = chunk("b0", 8, expires=1800), chunk("b0", 16, expires=1800)
    assert turn([lane("a", late, early)], {}, {"m"}, NOW)[0][1] == early
    assert turn([lane("a", tie_second, early, tie_first)], {}, {"m"}, NOW)[0][1] == tie_first
    closed = [
        chunk("b0", expires=1700, state=ChunkState.TAKEN),
        chunk("b1", expires=1700, running=False),
        chunk("b2", expires=int(NOW)),
        chunk("b3", expires=1700, not_before=NOW + 1),
    ]
    assert turn([lane("a", *closed, late)], {}, {"m"}, NOW)[0][1] == late
    waited = chunk("b4", expires=1700, not_before=NOW)
    assert turn([lane("a", waited, late)], {}, {"m"}, NOW)[0][1] == waited


def test_a_claim_takes_at_most_its_lanes_of_those_it_looks_at() -> None:
    many = [lane(f"o{i:02d}", vtime=float(i)) for i in range(LANES_PER_CLAIM + 3)]
    assert orgs_in_turn(many) == [f"o{i:02d}" for i in range(LANES_PER_CLAIM)]
    # Lanes whose chunks all wait still take places among those looked at.
    waiting = [
        lane(f"w{i:02d}", chunk(not_before=NOW + 5), vtime=-1.0) for i in range(LANES_LOOKED_AT)
    ]
    assert orgs_in_turn([*waiting, *many]) == []
    assert orgs_in_turn([*waiting[1:], *many]) == ["o00"]


def test_only_the_engines_models_are_claimed() -> None:
    lanes = [lane("a", model="x"), lane("b", model="m")]
    assert [p.org_id for p in claim(lanes, {}, {"m"}, 10, NOW).picks] == ["b"]
    assert claim(lanes, {}, {"m", "x"}, 0, NOW).picks == ()


def test_lines_are_split_by_weight_and_move_virtual_time_by_lines_over_weight() -> None:
    lanes = [lane("a", weight=1, vtime=1.0), lane("b", weight=3, vtime=1.0)]
    outcome = claim(lanes, {}, {"m"}, 8, NOW)
    assert [(p.org_id, p.lines) for p in outcome.picks] == [
        ("a", (0, 1)),
        ("b", (0, 1, 2, 3, 4, 5)),
    ]
    assert outcome.vtimes == {("m", "a"): 3.0, ("m", "b"): 3.0}


def test_urgent_lanes_take_their_chunk_first() -> None:
    lanes = [lane("a"), lane("b", vtime=50.0, urgent_by=1500)]
    outcome = claim(lanes, {}, {"m"}, 10, NOW)
    assert [(p.org_id, len(p.lines)) for p in outcome.picks] == [("b", 8), ("a", 2)]


def test_a_lane_leases_only_lines_free_to_go_and_its_share_is_not_passed_on() -> None:
    half = chunk("b1", queued={0: None, 2: NOW, 3: NOW + 9, 5: NOW - 1})
    lanes = [lane("a", half), lane("b", vtime=0.5)]
    outcome = claim(lanes, {}, {"m"}, 12, NOW)
    # "a" had a share of 6 (its chunk's length is 8) and three lines free to go.
    assert [(p.org_id, p.lines) for p in outcome.picks] == [
        ("a", (0, 2, 5)),
        ("b", tuple(range(6))),
    ]
    assert outcome.vtimes == {("m", "a"): 3.0, ("m", "b"): 6.5}


def test_a_lane_that_reopens_starts_level_with_the_least_busy_lane() -> None:
    lanes = [
        lane("busy", vtime=40.0),
        lane("busier", vtime=30.0),
        lane("idle", vtime=5.0, ready=0),
        lane("elsewhere", vtime=1.0, model="n"),
    ]
    assert least_busy(lanes, "m") == 30.0
    assert least_busy(lanes, "other") is None
    assert level_on_reopen(5.0, 0, 30.0) == 30.0  # from below
    assert level_on_reopen(500.0, 0, 30.0) == 30.0  # and from above
    assert level_on_reopen(5.0, 2, 30.0) == 5.0  # a busy lane keeps its place
    assert level_on_reopen(5.0, 0, None) == 5.0  # alone, it keeps its time
