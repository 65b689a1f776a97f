"""The adaptive concurrency limit of shared engines (SPEC §9.5), as a pure state machine."""

from __future__ import annotations

import math

from backfill.adapters.engines.pressure import Flavor, parse
from backfill.domain.scheduling.concurrency import (
    ConcurrencyLimit,
    Mode,
    Pressure,
    SharedTargets,
    Signal,
)


def shared(maximum: int = 64, **targets: float) -> ConcurrencyLimit:
    return ConcurrencyLimit(maximum, Mode.SHARED, SharedTargets(**targets))  # type: ignore[arg-type]


def test_dedicated_is_fixed_at_its_maximum_whatever_it_sees() -> None:
    limit = ConcurrencyLimit(16, Mode.DEDICATED)
    assert limit.limit == 16
    assert limit.signal == Signal.FIXED
    assert not limit.on_pressure(Pressure(running=64, waiting=100), own=0)
    for _ in range(100):
        limit.on_latency(10.0, 0, now=1.0)
    limit.on_overload(30.0, now=1.0)
    assert limit.allowed(now=2.0) == 16


def test_known_slots_leave_interactive_requests_and_headroom_free() -> None:
    limit = shared(64, slots=64, headroom=2, headroom_sigmas=1)
    # 16 of the 36 running are Backfill's own: 20 interactive, headroom 2 + sqrt(20).
    limit.on_pressure(Pressure(running=36, waiting=0), own=16)
    assert limit.signal == Signal.METRICS
    assert limit.pressure == 20
    assert limit.limit == math.floor(64 - 20 - 2 - math.sqrt(20))


def test_an_engine_that_serves_people_first_still_keeps_headroom() -> None:
    targets = SharedTargets(slots=64, headroom=2, headroom_sigmas=0, engine_priority=True)
    limit = ConcurrencyLimit(64, Mode.SHARED, targets)
    # 20 interactive; 4 of Backfill's 30 wait at the engine: they count as its own.
    limit.on_pressure(Pressure(running=46, waiting=4), own=30)
    assert limit.pressure == 20
    # vLLM never preempts a running request for a waiting person: slots stay free for them.
    assert limit.limit == 64 - 20 - 2
    limit.on_pressure(Pressure(running=64, waiting=30), own=30)
    assert limit.limit == 0


def test_waiting_interactive_requests_count_and_a_full_engine_gives_nothing() -> None:
    limit = shared(64, slots=64)
    limit.on_pressure(Pressure(running=64, waiting=10), own=0)
    assert limit.limit == 0
    assert limit.allowed(now=0.0) == 0


def test_recovers_within_seconds_when_live_traffic_leaves_and_never_passes_its_maximum() -> None:
    limit = shared(32, slots=64, headroom=2)
    limit.on_pressure(Pressure(running=60, waiting=0), own=0, now=0.0)
    assert limit.limit == 0
    # A dip of a moment is not trusted: people's mean count still says they are there.
    limit.on_pressure(Pressure(running=0, waiting=0), own=0, now=0.1)
    assert limit.limit < 32
    limit.on_pressure(Pressure(running=0, waiting=0), own=0, now=2.5)
    assert limit.limit == 32


def test_the_headroom_follows_peoples_mean_not_a_momentary_dip() -> None:
    limit = shared(64, slots=64, headroom=2, headroom_sigmas=2)
    for i in range(50):
        limit.on_pressure(Pressure(running=16, waiting=0), own=0, now=0.1 * i)
    steady = limit.limit
    assert steady == math.floor(64 - 16 - 2 - 2 * 4)
    limit.on_pressure(Pressure(running=4, waiting=0), own=0, now=5.1)
    assert limit.limit <= steady + 2  # not 64 - 4 - 2 - 2 x 2 = 54


def test_engine_slots_reported_by_the_engine_are_used_when_settings_do_not_say() -> None:
    limit = shared(64, headroom=0, headroom_sigmas=0)
    limit.on_pressure(Pressure(running=10, waiting=0, slots=48), own=0)
    assert limit.limit == 38


def test_unknown_slots_follow_the_engines_queue_by_aimd() -> None:
    limit = shared(64)
    start = limit.limit
    for _ in range(30):
        limit.on_pressure(Pressure(running=8, waiting=0), own=limit.limit)
    grown = limit.limit
    assert start < grown <= 64
    limit.on_pressure(Pressure(running=64, waiting=3), own=grown)
    assert limit.limit == math.floor(grown * 0.75)


def test_a_full_kv_cache_starts_nothing_new() -> None:
    limit = shared(64, slots=64, kv_target=0.9)
    limit.on_pressure(Pressure(running=12, waiting=0, kv_usage=0.95), own=12)
    assert limit.limit == 12


def test_latency_aimd_backs_off_on_inflation_and_grows_back_when_it_clears() -> None:
    limit = shared(64, latency_tolerance=1.5)
    now = 0.0
    # At the floor: the limit grows.
    for _ in range(40):
        now += 0.1
        limit.on_latency(0.1, output_tokens=9, now=now)
    grown = limit.limit
    assert grown > 4
    # Twice as slow per token: it shrinks, round after round, but never below one.
    for _ in range(400):
        now += 0.1
        limit.on_latency(0.4, output_tokens=19, now=now)
    assert limit.limit < grown
    assert limit.pressure > 1.5
    for _ in range(2000):
        now += 0.1
        limit.on_latency(0.8, output_tokens=19, now=now)
    assert limit.limit >= 1
    # Its floor is the last minute's: an engine slower for good is the new normal.
    assert limit.pressure < 1.5


def one_sequence_engine(limit: ConcurrencyLimit, seconds: float) -> float:
    """Drive the latency signal as an engine that runs one request at a time: each of
    Backfill's requests takes as long as the number in flight times 0.25 s. Returns the
    share of the time spent above one request in flight."""
    now, above = 0.0, 0.0
    while now < seconds:
        took = 0.25 * (limit.limit if now else 1)  # the first one finds the engine idle
        now += 0.25  # one request completes per 0.25 s, whatever the limit
        above += 0.25 if limit.limit > 1 else 0.0
        limit.on_latency(took, output_tokens=0, now=now)
    return above / seconds


def test_latency_signal_does_not_keep_probing_a_level_that_inflates() -> None:
    limit = shared(2, latency_tolerance=1.5)
    # Every other round at 2 would be half the time; the ceiling's growing wait makes it rare.
    assert one_sequence_engine(limit, 600.0) < 0.1
    assert limit.limit == 1


def test_latency_signal_climbs_past_an_old_ceiling_once_the_engine_clears() -> None:
    limit = shared(64, latency_tolerance=1.5)
    now = 0.0
    for _ in range(80):  # at the floor: grows
        now += 0.05
        limit.on_latency(0.1, output_tokens=0, now=now)
    high = limit.limit
    for _ in range(3 * high):  # people arrive: latency triples
        now += 0.05
        limit.on_latency(0.3, output_tokens=0, now=now)
    assert limit.limit < high
    for _ in range(400):  # they leave: back to the floor; within the minute it is past
        now += 0.05
        limit.on_latency(0.1, output_tokens=0, now=now)
    assert now < 30.0
    assert limit.limit > high


def test_overload_halves_and_pauses_until_retry_after() -> None:
    limit = shared(64, slots=64, headroom=0, headroom_sigmas=0)
    limit.on_pressure(Pressure(running=0, waiting=0), own=0)
    assert limit.limit == 64
    limit.on_overload(2.0, now=10.0)
    assert limit.limit == 32
    assert limit.allowed(now=11.0) == 0
    assert limit.allowed(now=12.5) == 32


def test_lost_metrics_fall_back_to_latency() -> None:
    limit = shared(64, slots=64)
    limit.on_pressure(Pressure(running=64, waiting=0), own=0)
    assert limit.limit == 0
    limit.on_metrics_lost()
    assert limit.signal == Signal.LATENCY
    assert limit.limit == 1


VLLM_PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 12.0
vllm:num_requests_running{engine="0",model_name="b"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 2.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="a"} 1000.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="a"} 4.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="a"} 150.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="a"} 20.0
vllm:iteration_tokens_total_count{engine="0",model_name="a"} 60.0
vllm:iteration_tokens_total_sum{engine="0",model_name="a"} 170.0
"""

SGLANG_PAGE = b"""sglang:num_running_reqs{model_name="m"} 40.0
sglang:num_queue_reqs{model_name="m"} 0.0 1712345678
sglang:token_usage{model_name="m"} 0.5
sglang:max_running_requests{model_name="m"} 128
"""


def test_metrics_pages_of_vllm_and_sglang_are_read_and_summed_over_models() -> None:
    found = parse(VLLM_PAGE)
    load = Pressure(15.0, 2.0, kv_usage=0.25, itl_sum_s=4.5, itl_count=150.0, steps=60.0)
    assert found == (Flavor.VLLM, load)
    found = parse(SGLANG_PAGE)
    assert found == (Flavor.SGLANG, Pressure(40.0, 0.0, kv_usage=0.5, slots=128.0))
    assert parse(b"# nothing here\nllamacpp:requests_processing 1\n") is None
    assert parse(VLLM_PAGE, Flavor.SGLANG) is None
