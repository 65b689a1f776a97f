"""vLLM's priority policy in the continuous-batching model, driven with made-up times.

With ``priority_scheduling`` the waiting queue is in (priority, arrival) order, lower first.
A waiting request never preempts: it starts when a slot is free and its KV blocks can be
allocated. Only a running request that cannot get the KV blocks for its next tokens
preempts, and its victim is the running request of the worst (priority, arrival), itself
included. Under fcfs the priority is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import pytest

from backfill.simulator.metrics import render
from backfill.simulator.model import BatchingConfig, BatchingModel, Phase, Sequence


def drain(model: BatchingModel) -> None:
    while (when := model.next_event_at()) is not None:
        model.advance(when)


def seq(prompt: int = 10, tokens: int = 50, at: float = 0.0, priority: int = 0) -> Sequence:
    return Sequence(prompt_tokens=prompt, max_tokens=tokens, arrived_at=at, priority=priority)


def submit(model: BatchingModel, *seqs: Sequence) -> None:
    for s in seqs:
        model.submit(s, s.arrived_at)


def phase(s: Sequence) -> Phase:
    """Read afresh: mypy would keep the phase an earlier assert narrowed."""
    return s.phase


def priority_model(**overrides: Any) -> BatchingModel:
    config: dict[str, Any] = {
        "slots": 2,
        "ttft_ms": 0,
        "itl_ms": 1,
        "priority_scheduling": True,
    }
    config.update(overrides)
    return BatchingModel(BatchingConfig(**config))


def assert_idle_and_exact(model: BatchingModel, seqs: list[Sequence]) -> None:
    assert all(s.phase is Phase.DONE for s in seqs)
    assert all(model.generated(s) == s.max_tokens for s in seqs)
    assert (model.running, model.waiting) == (0, 0)
    assert model.used_blocks() == 0
    assert model.kv_cache_usage() == 0
    snapshot = model.snapshot()
    assert snapshot.generation_tokens == sum(s.max_tokens for s in seqs)
    assert snapshot.ttft is not None
    assert snapshot.ttft.count == len(seqs)
    assert snapshot.queue_time is not None
    assert snapshot.queue_time.count == len(seqs)


def test_fcfs_accepts_a_priority_and_ignores_it() -> None:
    model = BatchingModel(BatchingConfig(slots=1, ttft_ms=0, itl_ms=1))
    first = seq(priority=9)
    queued = [seq(priority=p, at=0.001 * (i + 1)) for i, p in enumerate([5, 0, -3])]
    submit(model, first, *queued)
    drain(model)
    order = sorted(queued, key=lambda s: s.admitted_at or 0.0)
    assert order == queued  # arrival order
    assert model.preemptions == 0
    assert_idle_and_exact(model, [first, *queued])


def test_the_queue_is_in_priority_then_arrival_order() -> None:
    model = priority_model(slots=1)
    first = seq(priority=9)
    queued = [seq(priority=p, at=0.001 * (i + 1)) for i, p in enumerate([5, 1, 0, 1, -2, 5])]
    submit(model, first, *queued)
    model.advance(0.0065)
    assert (model.running, model.waiting, model.preemptions) == (1, 6, 0)
    drain(model)
    order = sorted(queued, key=lambda s: s.admitted_at or 0.0)
    assert [(s.priority, queued.index(s)) for s in order] == [
        (-2, 4), (0, 2), (1, 1), (1, 3), (5, 0), (5, 5)
    ]  # fmt: skip
    assert model.preemptions == 0
    assert_idle_and_exact(model, [first, *queued])


@pytest.mark.parametrize("priority", [-10, 0, 9])
def test_a_better_priority_waits_for_a_free_slot_and_never_preempts(priority: int) -> None:
    model = priority_model(slots=1)
    running = seq(priority=5, tokens=20)
    early = seq(priority=7, tokens=5, at=0.002)
    urgent = seq(priority=priority, tokens=5, at=0.005)
    submit(model, running, early, urgent)
    model.advance(0.006)
    assert (phase(running), phase(early), phase(urgent)) == (
        Phase.DECODE,
        Phase.WAITING,
        Phase.WAITING,
    )
    drain(model)
    assert model.preemptions == 0
    assert running.finished_at == pytest.approx(0.020)
    # When the slot frees, the better of the two waiters goes first, whatever came first.
    second = urgent if priority < 7 else early
    assert second.admitted_at == running.finished_at
    assert_idle_and_exact(model, [running, early, urgent])


def test_a_waiting_request_that_does_not_fit_preempts_nothing() -> None:
    model = priority_model(slots=8, block_tokens=16, kv_capacity_tokens=128)
    low = seq(prompt=100, tokens=20, priority=9)
    high = seq(prompt=40, tokens=3, priority=-9, at=0.005)
    submit(model, low, high)
    model.advance(0.006)
    assert (phase(low), phase(high), model.preemptions) == (Phase.DECODE, Phase.WAITING, 0)
    drain(model)
    assert model.preemptions == 0
    assert high.admitted_at == low.finished_at
    assert_idle_and_exact(model, [low, high])


def kv_model(**overrides: Any) -> BatchingModel:
    """Blocks of four tokens, steps of 1 ms whatever runs in them."""
    return priority_model(slots=4, block_tokens=4, **overrides)


def test_kv_pressure_preempts_the_worst_priority_even_the_request_itself() -> None:
    # The fcfs test's scenario (test_model.py), priorities reversed: A, first in the running
    # list, is the worse. At 5 ms both need a third block, none is free: A, the worst,
    # preempts itself and nothing more is scheduled in that step; B alone goes on.
    model = kv_model(kv_capacity_tokens=16)
    a, b = seq(prompt=4, tokens=10, priority=5), seq(prompt=4, tokens=10, priority=0)
    submit(model, a, b)
    model.advance(0.005)
    assert (phase(a), phase(b)) == (Phase.WAITING, Phase.DECODE)
    assert (a.preemptions, a.resumed_tokens, model.preemptions) == (1, 5, 1)
    drain(model)
    # B's 6th token comes 1 ms later (the step A gave up took no time); B ends at 10 ms.
    # A's 9 tokens are computed again in one step: its 6th token at 11 ms, its 10th at 15.
    assert b.finished_at == pytest.approx(0.010)
    assert a.finished_at == pytest.approx(0.015)
    assert model.preemptions == 1
    itl = model.inter_token_latency
    assert itl.count == 2 * 9
    assert itl.total == pytest.approx(9 * 0.001 + 8 * 0.001 + 0.006)
    assert_idle_and_exact(model, [a, b])


def test_the_victim_may_be_a_request_already_scheduled_in_the_step() -> None:
    # Three blocks. B (worse, scheduled first) has 5 prompt tokens, A 4: at 1 ms A needs a
    # second block and B does not. B gets its token's place in the step first; then A
    # preempts it, the worst running request, and the step runs A alone.
    model = kv_model(kv_capacity_tokens=12)
    b = seq(prompt=5, tokens=6, priority=3)
    a = seq(prompt=4, tokens=6, priority=1, at=0.0)
    submit(model, b, a)
    model.advance(0.001)
    assert (phase(a), phase(b), model.preemptions) == (Phase.DECODE, Phase.WAITING, 1)
    assert model.generated(b) == b.resumed_tokens == 1
    drain(model)
    # A ends at 6 ms; B computes its 6 tokens again (7 ms: its 2nd token), ends at 11 ms.
    assert a.finished_at == pytest.approx(0.006)
    assert b.finished_at == pytest.approx(0.011)
    assert_idle_and_exact(model, [a, b])


def test_equal_priorities_give_up_the_latest_arrival() -> None:
    model = kv_model(kv_capacity_tokens=16)
    a, b = seq(prompt=4, tokens=10, priority=2), seq(prompt=4, tokens=10, priority=2)
    submit(model, a, b)
    model.advance(0.005)
    assert (phase(a), phase(b), model.preemptions) == (Phase.DECODE, Phase.WAITING, 1)
    drain(model)
    assert_idle_and_exact(model, [a, b])


def test_preemptions_are_published_under_vllms_name() -> None:
    model = kv_model(kv_capacity_tokens=16)
    submit(model, seq(prompt=4, tokens=10, priority=1), seq(prompt=4, tokens=10))
    drain(model)
    text = render(model.snapshot(), "m")
    assert "# TYPE vllm:num_preemptions_total counter" in text
    assert 'vllm:num_preemptions_total{model_name="m",engine="0"} 1.0' in text
