"""The claim's split among the lanes it picks (weighted fair queueing), and the weight range."""

from __future__ import annotations

import random

import pytest

from backfill.domain.scheduling.fair_share import (
    MAX_WEIGHT,
    LaneTurn,
    WeightRefused,
    check_weight,
    split_claim,
    vtime_step,
)


def lane(vtime: float = 0.0, weight: int = 1, *, urgent: bool = False, room: int = 256) -> LaneTurn:
    return LaneTurn(vtime=vtime, weight=weight, urgent=urgent, room=room)


def test_level_lanes_split_in_the_ratio_of_their_weights() -> None:
    assert split_claim(40, [lane(weight=1), lane(weight=3)]) == [10, 30]
    assert split_claim(40, [lane(), lane()]) == [20, 20]
    assert split_claim(7, [lane(weight=2), lane(weight=5)]) == [2, 5]


def test_the_split_never_exceeds_the_limit_or_a_chunk() -> None:
    assert split_claim(10, [lane(room=3), lane(room=100)]) == [3, 7]
    assert split_claim(10, [lane(room=3), lane(room=2)]) == [3, 2]
    assert split_claim(0, [lane(), lane()]) == [0, 0]
    assert split_claim(5, []) == []


def test_a_lane_behind_in_virtual_time_catches_up_first() -> None:
    # Lane 0 is 10 lines behind: it gets those, then the rest is shared evenly.
    assert split_claim(10, [lane(vtime=0), lane(vtime=10)]) == [10, 0]
    assert split_claim(30, [lane(vtime=0), lane(vtime=10)]) == [20, 10]


def test_urgent_lanes_take_their_chunk_first_in_the_order_given() -> None:
    lanes = [lane(urgent=True, room=30), lane(urgent=True, room=30), lane(vtime=-100)]
    assert split_claim(40, lanes) == [30, 10, 0]
    assert split_claim(100, lanes) == [30, 30, 40]


def test_small_claims_repeated_follow_the_weights_without_rounding_bias() -> None:
    """Claims of one line each: a split that rounded each claim on its own would give every
    line to the heavier lane; carrying the virtual time over gives 1:3 exactly."""
    vtimes = [0.0, 0.0]
    weights = [1, 3]
    served = [0, 0]
    for _ in range(400):
        shares = split_claim(1, [lane(vtimes[i], weights[i]) for i in range(2)])
        for i, share in enumerate(shares):
            served[i] += share
            vtimes[i] += share / weights[i]
    assert served == [100, 300]


def test_random_claims_keep_every_lane_within_a_line_of_its_weighted_share() -> None:
    rng = random.Random(7)
    weights = [1, 2, 7]
    vtimes = [0.0, 0.0, 0.0]
    served = [0, 0, 0]
    for _ in range(2000):
        shares = split_claim(rng.randint(1, 40), [lane(vtimes[i], weights[i]) for i in range(3)])
        for i, share in enumerate(shares):
            served[i] += share
            vtimes[i] += share / weights[i]
    total = sum(served)
    for i, weight in enumerate(weights):
        assert abs(served[i] - total * weight / sum(weights)) <= weight + 1


@pytest.mark.parametrize("weight", [1, 3, MAX_WEIGHT])
def test_weights_in_range_are_taken(weight: int) -> None:
    assert check_weight(weight) == weight


@pytest.mark.parametrize("weight", [0, -1, MAX_WEIGHT + 1, 2.5, "3", True, None])
def test_other_weights_are_refused_naming_the_field(weight: object) -> None:
    with pytest.raises(WeightRefused) as refused:
        check_weight(weight)
    assert refused.value.param == "weight"
    assert f"from 1 to {MAX_WEIGHT}" in refused.value.message


def test_a_lanes_virtual_time_moves_by_its_lines_over_its_weight() -> None:
    assert vtime_step(6, 3) == 2.0
    assert vtime_step(0, 7) == 0.0
    # The split counts a lane's turns in the same steps.
    assert split_claim(4, [lane(vtime=vtime_step(1, 1)), lane(weight=2)]) == [1, 3]
