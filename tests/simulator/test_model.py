"""The continuous-batching model of the simulated engine, driven with made-up times.

The model has no clock: every call gets the time, so these tests run its events one by one
and compare model times exactly. No wall clock is read. The scenarios follow vLLM V1's
``Scheduler.schedule()``: running requests first, then waiting ones; KV blocks; preemption
only when a running request cannot grow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from backfill.simulator.model import BatchingConfig, BatchingModel, Phase, Sequence
from backfill.simulator.prefix_cache import block_hashes


def drain(model: BatchingModel) -> None:
    """Run every event until the engine is idle."""
    while (when := model.next_event_at()) is not None:
        model.advance(when)


def run_steps(model: BatchingModel, steps: int) -> None:
    """Run events until ``steps`` engine steps have ended."""
    while model.steps < steps:
        when = model.next_event_at()
        assert when is not None
        model.advance(when)


def seq(
    prompt: int = 10, tokens: int = 5, at: float = 0.0, block_hashes: tuple[int, ...] = ()
) -> Sequence:
    return Sequence(
        prompt_tokens=prompt, max_tokens=tokens, arrived_at=at, block_hashes=block_hashes
    )


def submit(model: BatchingModel, *seqs: Sequence) -> None:
    for s in seqs:
        model.submit(s, s.arrived_at)


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
    submit(model, *seqs)
    model.advance(0.0)
    assert (model.running, model.waiting) == (0, 0)  # still in the API server (ttft_ms)
    model.advance(0.010)
    assert (model.running, model.waiting) == (4, 6)
    assert [s.phase for s in seqs[4:]] == [Phase.WAITING] * 6
    drain(model)
    assert model.peak_running == 4
    assert (model.running, model.waiting) == (0, 0)
    assert all(s.phase is Phase.DONE for s in seqs)
    firsts = [ttft(s) for s in seqs]
    assert firsts == sorted(firsts)
    assert firsts[4] > firsts[3]  # the fifth waited for a slot


def test_time_to_first_token_is_api_latency_queue_wait_and_the_prefill_step() -> None:
    config = BatchingConfig(slots=1, ttft_ms=10, prefill_ms_per_token=1, itl_ms=2)
    model = BatchingModel(config)
    first, second = seq(prompt=20, tokens=5), seq(prompt=20, tokens=5)
    submit(model, first, second)
    drain(model)
    # Both reach the queue at 10 ms. The first's prefill step: 2 * (1 + 0) + 1 * 20 ms.
    assert first.first_token_at == pytest.approx(0.010 + 0.022)
    # Four decode steps of 2 ms; then the second starts and has its own prefill step.
    assert first.finished_at == pytest.approx(0.032 + 4 * 0.002)
    assert second.admitted_at == pytest.approx(0.040)
    assert second.first_token_at == pytest.approx(0.040 + 0.022)
    assert model.queue_time.total == pytest.approx(0.030)


def test_a_step_lasts_its_base_time_grown_by_its_requests_plus_its_prefill_tokens() -> None:
    config = BatchingConfig(slots=4, ttft_ms=0, itl_ms=10, itl_growth=1.0, prefill_ms_per_token=0.5)
    assert config.step_s(2, 4) == pytest.approx((10 * (1 + 2 / 4) + 0.5 * 4) / 1000)
    model = BatchingModel(config)
    a = seq(prompt=8, tokens=3)
    b = seq(prompt=4, tokens=3, at=0.010)
    submit(model, a, b)
    drain(model)
    # Step 1, A's prefill alone: 10 * (1 + 1/4) + 0.5 * 8 = 16.5 ms. B arrives during it.
    assert a.first_token_at == pytest.approx(0.0165)
    # Step 2, A decodes and B prefills: 10 * (1 + 2/4) + 0.5 * 4 = 17 ms.
    assert b.admitted_at == pytest.approx(0.0165)
    assert b.first_token_at == pytest.approx(0.0335)
    # Step 3, both decode: 15 ms, A's last token. Step 4, B alone: 12.5 ms.
    assert a.finished_at == pytest.approx(0.0485)
    assert b.finished_at == pytest.approx(0.061)
    # One inter-token latency per token after the first: the step it came in.
    itl = model.inter_token_latency
    assert itl.count == 4
    assert itl.total == pytest.approx(0.017 + 0.015 + 0.015 + 0.0125)
    assert model.decode_time.count == 2
    assert model.decode_time.total == pytest.approx(0.032 + 0.0275)
    tokens = model.iteration_tokens
    assert (tokens.count, tokens.total) == (4, 8 + (1 + 4) + 2 + 1)


def test_every_running_sequence_slows_every_step() -> None:
    config = BatchingConfig(slots=8, ttft_ms=0, itl_ms=4, itl_growth=1.0)
    alone = BatchingModel(config)
    single = seq(tokens=11)
    submit(alone, single)
    drain(alone)
    full = BatchingModel(config)
    crowd = [seq(tokens=11) for _ in range(8)]
    submit(full, *crowd)
    drain(full)
    # itl_ms * (1 + growth * scheduled / slots): 10 steps of 4.5 ms alone, of 8 ms with 8.
    assert decode_s(single) == pytest.approx(10 * 0.0045)
    assert all(decode_s(s) == pytest.approx(10 * 0.008) for s in crowd)
    assert ttft(single) == pytest.approx(0.0045)
    assert ttft(crowd[0]) == pytest.approx(0.008)


def test_a_step_holds_its_base_time_up_to_the_knee_then_grows_by_each_sequence_past_it() -> None:
    # A CPU whose step is bound by memory up to four sequences, then by compute.
    config = BatchingConfig(slots=8, ttft_ms=0, itl_ms=30, itl_growth=0.8, itl_knee=4)
    steps_ms = [1000 * config.step_s(n, 0) for n in (1, 2, 4, 5, 8)]
    assert steps_ms == pytest.approx([30, 30, 30, 33, 42])
    # Without a knee every sequence counts, as before.
    line = BatchingConfig(slots=8, ttft_ms=0, itl_ms=30, itl_growth=0.8)
    assert 1000 * line.step_s(4, 0) == pytest.approx(42)
    crowd = [seq(tokens=11) for _ in range(4)]
    model = BatchingModel(config)
    submit(model, *crowd)
    drain(model)
    assert all(decode_s(s) == pytest.approx(10 * 0.030) for s in crowd)


def test_a_long_prompt_is_prefilled_in_chunks_that_slow_the_decoders() -> None:
    config = BatchingConfig(
        slots=4, ttft_ms=0, itl_ms=10, prefill_ms_per_token=0.1, max_num_batched_tokens=256
    )
    model = BatchingModel(config)
    decoder = seq(prompt=1, tokens=100)
    long = seq(prompt=1000, tokens=2, at=0.005)  # it arrives during the decoder's prefill
    submit(model, decoder, long)
    run_steps(model, 1)
    assert decoder.first_token_at == pytest.approx(0.0101)
    run_steps(model, 5)
    # Each step: the decoder's token, then 255 prompt tokens (the budget less one), three
    # times, then the last 235: 10 + 25.5 ms thrice, then 10 + 23.5 ms.
    first = long.first_token_at
    assert first is not None
    assert first == pytest.approx(0.0101 + 3 * 0.0355 + 0.0335)
    assert model.generated(decoder) == 5
    assert model.iteration_tokens.total == 1 + 3 * 256 + (1 + 235)
    drain(model)
    assert long.finished_at == pytest.approx(first + 0.010)


def test_no_decode_time_finishes_at_the_first_token() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=5, itl_ms=0))
    s = seq(tokens=64)
    submit(model, s)
    drain(model)
    assert s.phase is Phase.DONE
    assert s.finished_at == s.first_token_at == pytest.approx(0.005)
    assert model.generated(s) == 64


def test_an_empty_answer_ends_at_prefill() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=5, itl_ms=1))
    s = seq(tokens=0)
    submit(model, s)
    drain(model)
    assert s.phase is Phase.DONE
    assert model.generated(s) == 0
    assert model.snapshot().generation_tokens == 0


def test_generated_tokens_grow_one_per_step() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=10, itl_ms=1))
    s = seq(tokens=50)
    submit(model, s)
    model.advance(0.0109)  # queued at 10 ms; its prefill step lasts 1 ms
    assert model.generated(s) == 0
    model.advance(0.011)
    assert model.generated(s) == 1
    model.advance(0.011 + 10 * 0.001 + 0.0005)
    assert model.generated(s) == 11
    assert model.snapshot().generation_tokens == 11


def test_cached_prefix_is_not_prefilled_and_is_counted_in_tokens() -> None:
    config = BatchingConfig(
        slots=4, ttft_ms=10, prefill_ms_per_token=1, itl_ms=1, prefix_cache_blocks=100
    )
    model = BatchingModel(config)
    words = [f"w{i}" for i in range(100)]
    first = seq(prompt=101, block_hashes=block_hashes([*words, "a"], 16))
    submit(model, first)
    drain(model)
    second = seq(prompt=101, at=1.0, block_hashes=block_hashes([*words, "b"], 16))
    submit(model, second)
    drain(model)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # six full blocks of 16; the 7th is partial
    # 10 ms to the queue, then a prefill step of 1 ms and 1 ms per new prompt token.
    assert ttft(first) == pytest.approx((10 + 1 + 101) / 1000)
    assert ttft(second) == pytest.approx((10 + 1 + 5) / 1000)
    snapshot = model.snapshot()
    assert snapshot.prefix_cache_queries == 202
    assert snapshot.prefix_cache_hits == 96


def test_a_whole_cached_prompt_still_computes_its_last_block() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=1, itl_ms=1, prefix_cache_blocks=10))
    hashes = block_hashes([f"w{i}" for i in range(32)], 16)
    for at in (0.0, 1.0):
        submit(model, seq(prompt=32, at=at, block_hashes=hashes))
        drain(model)
    # 32 tokens = 2 blocks, but at most 31 may come from the cache: one block.
    assert model.prefix_cache_hits == 16


def test_the_prefix_cache_only_counts_when_it_is_on() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=1, itl_ms=1))
    hashes = block_hashes([f"w{i}" for i in range(64)], 16)
    for at in (0.0, 1.0):
        submit(model, seq(prompt=64, at=at, block_hashes=hashes))
        drain(model)
    assert (model.prefix_cache_queries, model.prefix_cache_hits) == (0, 0)


def test_kv_usage_counts_the_blocks_of_computed_and_computing_tokens() -> None:
    config = BatchingConfig(slots=4, ttft_ms=10, itl_ms=1, kv_capacity_tokens=1600)
    model = BatchingModel(config)
    submit(model, seq(prompt=100, tokens=50), seq(prompt=100, tokens=50))
    model.advance(0.010)
    assert model.used_blocks() == 2 * 7  # 100 prompt tokens each: ceil(100 / 16)
    run_steps(model, 12)  # the prefill and 11 decode steps: 111 computed, the 112th next
    assert model.used_blocks() == 2 * 7
    run_steps(model, 13)  # the 113th token starts an 8th block
    assert model.used_blocks() == 2 * 8
    assert model.kv_cache_usage() == pytest.approx(16 / 100)
    drain(model)
    assert model.used_blocks() == 0


def test_a_waiting_request_that_does_not_fit_waits_and_preempts_nothing() -> None:
    # Eight blocks of 16 tokens: the first request holds 7, the second's prompt needs 3.
    config = BatchingConfig(slots=8, ttft_ms=0, itl_ms=1, kv_capacity_tokens=128)
    model = BatchingModel(config)
    big = seq(prompt=100, tokens=20)
    small = seq(prompt=40, tokens=3, at=0.005)
    behind = seq(prompt=1, tokens=3, at=0.006)  # would fit, but waits behind the head
    submit(model, big, small, behind)
    model.advance(0.0065)
    assert (model.running, model.waiting) == (1, 2)
    assert phase(big) is Phase.DECODE
    drain(model)
    assert model.preemptions == 0
    assert small.admitted_at == big.finished_at
    assert behind.admitted_at == big.finished_at
    assert model.peak_running == 2


def test_a_request_larger_than_the_cache_runs_when_no_other_holds_a_block() -> None:
    config = BatchingConfig(slots=2, ttft_ms=1, itl_ms=1, kv_capacity_tokens=32)
    model = BatchingModel(config)
    big = seq(prompt=50)
    submit(model, big)
    model.advance(0.001)
    assert model.running == 1
    assert model.used_blocks() == 4  # over the cache's two blocks
    assert model.kv_cache_usage() == 1.0
    other = seq(prompt=1, at=0.002)
    submit(model, other)
    model.advance(0.003)
    assert phase(other) is Phase.WAITING
    drain(model)
    assert (big.phase, other.phase, model.preemptions) == (Phase.DONE, Phase.DONE, 0)
    assert other.admitted_at == big.finished_at


def kv_pressure_model(**overrides: Any) -> BatchingModel:
    """Four blocks of four tokens, steps of 1 ms whatever runs in them."""
    config: dict[str, Any] = {
        "slots": 4,
        "ttft_ms": 0,
        "itl_ms": 1,
        "block_tokens": 4,
        "kv_capacity_tokens": 16,
    }
    config.update(overrides)
    return BatchingModel(BatchingConfig(**config))


def test_kv_pressure_preempts_the_last_scheduled_under_fcfs_exactly() -> None:
    model = kv_pressure_model()
    a, b = seq(prompt=4, tokens=10), seq(prompt=4, tokens=10)
    c = seq(prompt=4, tokens=2, at=0.0055)
    submit(model, a, b, c)
    # Step 1 prefills both (a block each); step 2 gives each a second block; at 5 ms both
    # have 8 tokens computed and need a third block, with none free: A, first in the
    # running list, preempts the last one scheduled, B, which had 5 tokens out.
    model.advance(0.005)
    assert (phase(b), model.generated(b), b.resumed_tokens) == (Phase.WAITING, 5, 5)
    assert (model.preemptions, b.preemptions, model.used_blocks()) == (1, 1, 3)
    # B is back at the head of the queue and needs 3 blocks for its 9 tokens: it waits,
    # and so does C behind it though C's one block would fit.
    model.advance(0.006)
    assert (phase(b), phase(c), model.waiting) == (Phase.WAITING, Phase.WAITING, 2)
    # A ends at 10 ms (10 tokens); B (3 blocks) and C (1 block) start together. At 11 ms C
    # has its first token and needs a second block: C, the last scheduled, preempts itself.
    model.advance(0.0105)
    assert a.finished_at == pytest.approx(0.010)
    assert (phase(b), phase(c), model.used_blocks()) == (Phase.PREFILL, Phase.PREFILL, 4)
    model.advance(0.0111)
    assert c.first_token_at == pytest.approx(0.011)
    assert phase(c) is Phase.WAITING
    assert (c.preemptions, c.resumed_tokens, model.preemptions) == (1, 1, 2)
    drain(model)
    # B: its 6th token (the first after the recompute) at 11 ms, its 10th at 15 ms; then
    # C's recompute of 5 tokens gives its 2nd and last at 16 ms.
    assert b.finished_at == pytest.approx(0.015)
    assert c.finished_at == pytest.approx(0.016)
    assert ttft(b) == pytest.approx(0.001)  # observed once, before the preemption
    assert model.preemptions == 2
    assert model.ttft.count == 3
    assert model.snapshot().generation_tokens == 10 + 10 + 2
    # B's resumed token came 6 ms after its 5th, C's 2nd 5 ms after its 1st.
    itl = model.inter_token_latency
    assert itl.count == 9 + 9 + 1
    assert itl.total == pytest.approx(9 * 0.001 + 8 * 0.001 + 0.006 + 0.005)
    assert (model.running, model.waiting, model.used_blocks()) == (0, 0, 0)


def test_a_resumed_request_recomputes_its_tokens_and_may_hit_the_prefix_cache() -> None:
    model = kv_pressure_model(kv_capacity_tokens=24, prefix_cache_blocks=100)
    a = seq(prompt=8, tokens=12, block_hashes=block_hashes([f"a{i}" for i in range(8)], 4))
    b = seq(prompt=8, tokens=12, block_hashes=block_hashes([f"b{i}" for i in range(8)], 4))
    submit(model, a, b)
    model.advance(0.005)  # both at 12 computed tokens; B is preempted with 5 tokens out
    assert (phase(b), b.resumed_tokens) == (Phase.WAITING, 5)
    drain(model)
    assert b.preemptions == 1
    # A ends at 12 ms; B's prompt's first block comes from the cache, 4 + 5 tokens are
    # computed again, and its 6th token comes at 13 ms, its 12th at 19 ms.
    assert a.finished_at == pytest.approx(0.012)
    assert b.finished_at == pytest.approx(0.019)
    assert model.prefix_cache_queries == 8 + 8 + (8 + 5)
    assert model.prefix_cache_hits == 4
    assert b.cached_tokens == 0  # usage keeps the first admission's count
    assert model.snapshot().generation_tokens == 24


def test_a_request_preempted_in_its_prefill_gets_one_time_to_first_token() -> None:
    # Three blocks; a budget of 4 tokens a step, so B's 8-token prompt takes chunks.
    model = kv_pressure_model(slots=2, kv_capacity_tokens=12, max_num_batched_tokens=4)
    a, b = seq(prompt=4, tokens=20), seq(prompt=8, tokens=2)
    submit(model, a, b)
    run_steps(model, 1)  # A's prefill; step 2: A's 2nd token and B's first chunk of 3
    assert (phase(b), model.used_blocks()) == (Phase.PREFILL, 3)
    run_steps(model, 2)  # B's next chunk needs a block: B, the last scheduled, gives way
    assert (phase(b), b.preemptions, model.generated(b)) == (Phase.WAITING, 1, 0)
    assert b.first_token_at is None
    drain(model)
    # A (alone, it may outgrow the cache) ends at 20 ms; B is prefilled in two chunks of 4.
    assert a.finished_at == pytest.approx(0.020)
    assert b.first_token_at == pytest.approx(0.022)
    assert b.finished_at == pytest.approx(0.023)
    assert (model.ttft.count, model.queue_time.count) == (2, 2)


def test_a_preempted_request_that_leaves_counts_the_tokens_it_had_sent() -> None:
    model = kv_pressure_model()
    a, b = seq(prompt=4, tokens=10), seq(prompt=4, tokens=10)
    submit(model, a, b)
    model.advance(0.005)
    assert (phase(b), model.waiting) == (Phase.WAITING, 1)
    model.abort(b, 0.0055)
    assert (phase(b), model.waiting) == (Phase.ABORTED, 0)
    drain(model)
    assert (model.running, model.waiting, model.used_blocks()) == (0, 0, 0)
    assert model.snapshot().generation_tokens == 10 + 5


def test_aborting_frees_the_slot_for_the_next_in_line() -> None:
    model = BatchingModel(BatchingConfig(slots=1, ttft_ms=10, itl_ms=1))
    running, queued, last = seq(tokens=100), seq(), seq()
    submit(model, running, queued, last)
    model.advance(0.0205)
    assert running.phase is Phase.DECODE
    model.abort(queued, 0.0205)
    assert queued.phase is Phase.ABORTED
    assert model.waiting == 1
    model.abort(running, 0.0205)
    assert model.running == 0
    # The step under way runs to its end (21 ms); the next one starts the last request.
    model.advance(0.0209)
    assert phase(last) is Phase.WAITING
    model.advance(0.0210001)
    assert phase(last) is Phase.PREFILL
    assert last.admitted_at == pytest.approx(0.021)
    drain(model)
    assert phase(last) is Phase.DONE
    assert model.snapshot().finished == {"length": 1}


def test_an_abort_on_an_idle_engine_lets_the_queue_start_at_once() -> None:
    model = BatchingModel(BatchingConfig(slots=1, ttft_ms=0, itl_ms=1))
    slow = Sequence(prompt_tokens=1, max_tokens=3, arrived_at=0.0, extra_prefill_s=1.0)
    other = seq()
    submit(model, slow, other)
    model.advance(0.5)  # the delayed request holds the slot and computes nothing
    assert (phase(slow), phase(other)) == (Phase.PREFILL, Phase.WAITING)
    assert model.next_event_at() == 1.0
    model.abort(slow, 0.5)
    assert model.next_event_at() == 0.5
    model.advance(0.5)
    assert other.admitted_at == 0.5


def test_aborting_a_prefill_or_a_finished_request_is_safe() -> None:
    model = BatchingModel(BatchingConfig(slots=2, ttft_ms=0, itl_ms=1))
    a, b = seq(tokens=3), seq(tokens=3)
    submit(model, a, b)
    model.advance(0.0)
    model.abort(a, 0.0001)
    drain(model)
    model.abort(b, 1.0)
    assert (a.phase, b.phase) == (Phase.ABORTED, Phase.DONE)
    assert (model.running, model.used_blocks()) == (0, 0)


def test_a_delayed_request_holds_its_slot_and_then_prefills() -> None:
    model = BatchingModel(BatchingConfig(slots=1, ttft_ms=0, itl_ms=1))
    slow = Sequence(prompt_tokens=1, max_tokens=2, arrived_at=0.0, extra_prefill_s=0.1)
    behind = seq(tokens=2)
    submit(model, slow, behind)
    drain(model)
    # Its first chunk waits 100 ms; then steps of 1 ms.
    assert slow.first_token_at == pytest.approx(0.101)
    assert behind.admitted_at == slow.finished_at == pytest.approx(0.102)


@pytest.mark.parametrize(
    "make",
    [
        lambda: BatchingConfig(slots=0),
        lambda: BatchingConfig(slots=1, itl_ms=-1),
        lambda: BatchingConfig(slots=1, itl_growth=-0.5),
        lambda: BatchingConfig(slots=4, itl_knee=5),
        lambda: BatchingConfig(slots=1, kv_capacity_tokens=0),
        lambda: BatchingConfig(slots=1, block_tokens=0),
        lambda: BatchingConfig(slots=1, prefix_cache_blocks=-1),
        lambda: BatchingConfig(slots=1, kv_capacity_tokens=8, block_tokens=16),
        lambda: BatchingConfig(slots=64, max_num_batched_tokens=32),
    ],
)
def test_config_ranges(make: Callable[[], BatchingConfig]) -> None:
    with pytest.raises(ValueError):
        make()
