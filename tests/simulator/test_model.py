"""The continuous-batching model of the simulated engine, driven with made-up times.

The model has no clock: every call gets the time, so these tests run its events one by one
and compare model times exactly. No wall clock is read.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backfill.simulator.model import BatchingConfig, BatchingModel, Phase, Sequence
from backfill.simulator.prefix_cache import block_hashes


def drain(model: BatchingModel) -> None:
    """Run every event until the engine is idle."""
    while (when := model.next_event_at()) is not None:
        model.advance(when)


def seq(
    prompt: int = 10, tokens: int = 5, at: float = 0.0, block_hashes: tuple[int, ...] = ()
) -> Sequence:
    return Sequence(
        prompt_tokens=prompt, max_tokens=tokens, arrived_at=at, block_hashes=block_hashes
    )


def phase(s: Sequence) -> Phase:
    """Read afresh: mypy would keep the phase an earlier assert narrowed."""
    return s.phase


def ttft(s: Sequence) -> float:
    assert s.first_token_at is not None
    return s.first_token_at - s.arrived_at


def decode_s(s: Sequence) -> float:
    assert s.first_token_at is not None
    assert s.finished_at is not None
    return s.finished_at - s.first_token_at


def test_slots_cap_running_and_the_rest_wait_in_arrival_order() -> None:
    model = BatchingModel(BatchingConfig(slots=4, ttft_ms=10, itl_ms=1))
    seqs = [seq() for _ in range(10)]
    for s in seqs:
        model.submit(s, 0.0)
    assert (model.running, model.waiting) == (4, 6)
    assert [s.phase for s in seqs[4:]] == [Phase.WAITING] * 6
    drain(model)
    assert model.peak_running == 4
    assert (model.running, model.waiting) == (0, 0)
    assert all(s.phase is Phase.DONE for s in seqs)
    firsts = [ttft(s) for s in seqs]
    assert firsts == sorted(firsts)
    assert firsts[4] > firsts[3]  # the fifth waited for a slot


def test_time_to_first_token_is_queue_wait_plus_prefill() -> None:
    config = BatchingConfig(slots=1, ttft_ms=10, prefill_ms_per_token=1, itl_ms=2)
    model = BatchingModel(config)
    first, second = seq(prompt=20, tokens=5), seq(prompt=20, tokens=5)
    model.submit(first, 0.0)
    model.submit(second, 0.0)
    drain(model)
    prefill = (10 + 1 * 20) / 1000
    assert ttft(first) == pytest.approx(prefill)
    # The second waits for the first's prefill and its 4 decode steps of 2 ms, then prefills.
    assert second.admitted_at == pytest.approx(prefill + 4 * 0.002)
    assert ttft(second) == pytest.approx(prefill + 4 * 0.002 + prefill)


def test_time_to_first_token_does_not_grow_with_the_decode_batch() -> None:
    config = BatchingConfig(slots=64, ttft_ms=20, itl_ms=5, itl_growth=2.0)
    alone = BatchingModel(config)
    probe_alone = seq(prompt=50, tokens=4)
    alone.submit(probe_alone, 0.0)
    drain(alone)

    busy = BatchingModel(config)
    for _ in range(60):
        busy.submit(seq(prompt=50, tokens=500), 0.0)
    busy.advance(0.1)  # all sixty are decoding now
    assert busy.running == 60
    probe_busy = seq(prompt=50, tokens=4, at=0.1)
    busy.submit(probe_busy, 0.1)
    busy.advance(0.5)
    assert ttft(probe_busy) == pytest.approx(ttft(probe_alone))
    # ... while its decode is slower: more sequences share each step.
    assert decode_s(probe_busy) > 1.5 * decode_s(probe_alone)


def test_decode_steps_slow_down_as_more_sequences_run() -> None:
    config = BatchingConfig(slots=64, ttft_ms=1, itl_ms=4, itl_growth=1.0)
    alone = BatchingModel(config)
    single = seq(tokens=101)
    alone.submit(single, 0.0)
    drain(alone)

    full = BatchingModel(config)
    crowd = [seq(tokens=101) for _ in range(64)]
    for s in crowd:
        full.submit(s, 0.0)
    drain(full)
    # itl_ms * (1 + growth * running / slots): 64 running against 1.
    expected = (1 + 1.0 * 64 / 64) / (1 + 1.0 * 1 / 64)
    assert decode_s(crowd[0]) / decode_s(single) == pytest.approx(expected)
    assert decode_s(single) == pytest.approx(100 * 0.004 * (1 + 1 / 64))


def test_without_growth_the_step_time_stays_flat() -> None:
    config = BatchingConfig(slots=8, ttft_ms=1, itl_ms=3)
    model = BatchingModel(config)
    crowd = [seq(tokens=11) for _ in range(8)]
    for s in crowd:
        model.submit(s, 0.0)
    drain(model)
    assert decode_s(crowd[0]) == pytest.approx(10 * 0.003)


def test_no_decode_time_finishes_at_the_first_token() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=5, itl_ms=0))
    s = seq(tokens=64)
    model.submit(s, 0.0)
    drain(model)
    assert s.phase is Phase.DONE
    assert s.finished_at == s.first_token_at == pytest.approx(0.005)
    assert model.generated(s) == 64


def test_an_empty_answer_ends_at_prefill() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=5, itl_ms=1))
    s = seq(tokens=0)
    model.submit(s, 0.0)
    drain(model)
    assert s.phase is Phase.DONE
    assert model.generated(s) == 0
    assert model.snapshot().generation_tokens == 0


def test_generated_tokens_grow_one_per_step() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=10, itl_ms=1))
    s = seq(tokens=50)
    model.submit(s, 0.0)
    model.advance(0.0099)
    assert model.generated(s) == 0
    model.advance(0.010)
    assert model.generated(s) == 1
    model.advance(0.0205)  # ten steps of 1 ms later
    assert model.generated(s) == 11
    assert model.snapshot().generation_tokens == 11


def test_cached_prefix_is_not_prefilled_and_is_counted_in_tokens() -> None:
    config = BatchingConfig(
        slots=4, ttft_ms=10, prefill_ms_per_token=1, itl_ms=1, prefix_cache_blocks=100
    )
    model = BatchingModel(config)
    words = [f"w{i}" for i in range(100)]
    first = seq(prompt=101, block_hashes=block_hashes([*words, "a"], 16))
    model.submit(first, 0.0)
    drain(model)
    second = seq(prompt=101, at=1.0, block_hashes=block_hashes([*words, "b"], 16))
    model.submit(second, 1.0)
    drain(model)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # six full blocks of 16; the 7th is partial
    assert ttft(first) == pytest.approx((10 + 101) / 1000)
    assert ttft(second) == pytest.approx((10 + 5) / 1000)
    snapshot = model.snapshot()
    assert snapshot.prefix_cache_queries == 202
    assert snapshot.prefix_cache_hits == 96


def test_a_whole_cached_prompt_still_computes_its_last_block() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=1, itl_ms=1, prefix_cache_blocks=10))
    hashes = block_hashes([f"w{i}" for i in range(32)], 16)
    for at in (0.0, 1.0):
        model.submit(seq(prompt=32, at=at, block_hashes=hashes), at)
        drain(model)
    # 32 tokens = 2 blocks, but at most 31 may come from the cache: one block.
    assert model.prefix_cache_hits == 16


def test_the_prefix_cache_only_counts_when_it_is_on() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=1, itl_ms=1))
    hashes = block_hashes([f"w{i}" for i in range(64)], 16)
    for at in (0.0, 1.0):
        model.submit(seq(prompt=64, at=at, block_hashes=hashes), at)
        drain(model)
    assert (model.prefix_cache_queries, model.prefix_cache_hits) == (0, 0)


def test_prompts_wait_for_free_kv_tokens() -> None:
    model = BatchingModel(BatchingConfig(slots=8, ttft_ms=10, itl_ms=1, kv_capacity_tokens=100))
    seqs = [seq(prompt=40, tokens=3) for _ in range(4)]
    for s in seqs:
        model.submit(s, 0.0)
    assert (model.running, model.waiting) == (2, 2)
    assert model.kv_cache_usage() == pytest.approx(0.8)
    drain(model)
    assert all(s.phase is Phase.DONE for s in seqs)
    assert model.peak_running == 2


def test_a_prompt_larger_than_the_kv_cache_still_runs_alone() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=1, itl_ms=1, kv_capacity_tokens=10))
    big = seq(prompt=50)
    model.submit(big, 0.0)
    assert model.running == 1
    assert model.kv_cache_usage() == 1.0
    drain(model)
    assert big.phase is Phase.DONE


def test_kv_usage_counts_prompt_and_output_tokens_of_running_sequences() -> None:
    model = BatchingModel(BatchingConfig(slots=4, ttft_ms=10, itl_ms=1, kv_capacity_tokens=1000))
    model.submit(seq(prompt=100, tokens=50), 0.0)
    model.submit(seq(prompt=100, tokens=50), 0.0)
    model.advance(0.0105)  # first tokens at 10 ms, no step yet
    assert model.held_tokens() == 2 * (100 + 1)
    model.advance(0.0205)  # ten steps
    assert model.held_tokens() == 2 * (100 + 11)
    assert model.kv_cache_usage() == pytest.approx(0.222)
    drain(model)
    assert model.held_tokens() == 0


def test_aborting_frees_the_slot_for_the_next_in_line() -> None:
    model = BatchingModel(BatchingConfig(slots=1, ttft_ms=10, itl_ms=1))
    running, queued, last = seq(tokens=100), seq(), seq()
    for s in (running, queued, last):
        model.submit(s, 0.0)
    model.advance(0.02)
    assert running.phase is Phase.DECODE
    model.abort(queued, 0.02)
    assert queued.phase is Phase.ABORTED
    assert model.waiting == 1
    model.abort(running, 0.02)
    assert last.phase is Phase.PREFILL
    assert last.admitted_at == 0.02
    drain(model)
    assert phase(last) is Phase.DONE
    assert model.snapshot().finished == {"length": 1}


def test_aborting_a_prefill_or_a_finished_request_is_safe() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=10, itl_ms=1))
    a, b = seq(tokens=3), seq(tokens=3)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    model.abort(a, 0.001)
    drain(model)
    model.abort(b, 1.0)
    assert (a.phase, b.phase) == (Phase.ABORTED, Phase.DONE)
    assert model.running == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: BatchingConfig(slots=0),
        lambda: BatchingConfig(slots=1, itl_ms=-1),
        lambda: BatchingConfig(slots=1, itl_growth=-0.5),
        lambda: BatchingConfig(slots=1, kv_capacity_tokens=0),
        lambda: BatchingConfig(slots=1, block_tokens=0),
        lambda: BatchingConfig(slots=1, prefix_cache_blocks=-1),
    ],
)
def test_config_ranges(make: Callable[[], BatchingConfig]) -> None:
    with pytest.raises(ValueError):
        make()
