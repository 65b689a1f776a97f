"""vLLM's priority scheduling in the continuous-batching model, driven with made-up times.

With ``priority_scheduling`` the queue is in (priority, arrival) order, lower first, and a
waiting request that cannot start preempts running requests of a worse priority (the worst,
then the latest arrival, first). A preempted request keeps the tokens it had sent, is
prefilled again over prompt and those tokens, and generates the rest.
"""

from __future__ import annotations

import pytest

from backfill.simulator.metrics import render
from backfill.simulator.model import BatchingConfig, BatchingModel, Phase, Sequence
from backfill.simulator.prefix_cache import block_hashes


def drain(model: BatchingModel) -> None:
    while (when := model.next_event_at()) is not None:
        model.advance(when)


def seq(
    prompt: int = 10,
    tokens: int = 50,
    at: float = 0.0,
    priority: int = 0,
    hashes: tuple[int, ...] = (),
) -> Sequence:
    return Sequence(
        prompt_tokens=prompt,
        max_tokens=tokens,
        arrived_at=at,
        priority=priority,
        block_hashes=hashes,
    )


def phase(s: Sequence) -> Phase:
    """Read afresh: mypy would keep the phase an earlier assert narrowed."""
    return s.phase


def ttft(s: Sequence) -> float:
    assert s.first_token_at is not None
    return s.first_token_at - s.arrived_at


def priority_model(**overrides: float) -> BatchingModel:
    config: dict[str, float] = {"slots": 2, "ttft_ms": 10, "prefill_ms_per_token": 1, "itl_ms": 1}
    config.update(overrides)
    return BatchingModel(
        BatchingConfig(
            slots=int(config["slots"]),
            ttft_ms=config["ttft_ms"],
            prefill_ms_per_token=config["prefill_ms_per_token"],
            itl_ms=config["itl_ms"],
            kv_capacity_tokens=int(config.get("kv_capacity_tokens", 262_144)),
            prefix_cache_blocks=int(config.get("prefix_cache_blocks", 0)),
            priority_scheduling=True,
        )
    )


def assert_idle_and_exact(model: BatchingModel, seqs: list[Sequence]) -> None:
    assert all(s.phase is Phase.DONE for s in seqs)
    assert all(model.generated(s) == s.max_tokens for s in seqs)
    assert (model.running, model.waiting) == (0, 0)
    assert model.held_tokens() == 0
    assert model.kv_cache_usage() == 0
    snapshot = model.snapshot()
    assert snapshot.generation_tokens == sum(s.max_tokens for s in seqs)
    assert snapshot.ttft is not None
    assert snapshot.ttft.count == len(seqs)
    assert snapshot.queue_time is not None
    assert snapshot.queue_time.count == len(seqs)


def test_fcfs_refuses_a_priority_other_than_zero() -> None:
    model = BatchingModel(BatchingConfig(slots=2))
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not enabled"):
        model.submit(seq(priority=3), 0.0)
    assert model.waiting == model.running == 0
    model.submit(seq(priority=0), 0.0)
    assert model.running == 1


def test_the_queue_is_in_priority_then_arrival_order() -> None:
    model = priority_model(slots=1)
    first = seq(priority=-5)  # better than all: nothing preempts it
    model.submit(first, 0.0)
    queued = [seq(priority=p, at=0.001 * i) for i, p in enumerate([5, 1, 0, 1, -2, 5])]
    for s in queued:
        model.submit(s, s.arrived_at)
    assert (model.running, model.waiting, model.preemptions) == (1, 6, 0)
    drain(model)
    order = sorted(queued, key=lambda s: s.admitted_at or 0.0)
    assert [(s.priority, queued.index(s)) for s in order] == [
        (-2, 4), (0, 2), (1, 1), (1, 3), (5, 0), (5, 5)
    ]  # fmt: skip
    assert model.preemptions == 0
    assert_idle_and_exact(model, [first, *queued])


def test_an_urgent_arrival_preempts_at_once_and_the_victim_resumes_with_every_token() -> None:
    # Alone, a prompt of 10 tokens has its first token after 10 + 10 * 1 ms.
    alone = priority_model()
    probe = seq(priority=0, at=0.0)
    alone.submit(probe, 0.0)
    drain(alone)

    model = priority_model()
    early, late = seq(priority=5), seq(priority=5)
    model.submit(early, 0.0)
    model.submit(late, 0.0)
    model.advance(0.0305)  # first tokens at 20 ms, ten steps of 1 ms since
    assert model.generated(late) == 11
    assert model.held_tokens() == 2 * (10 + 11)

    urgent = seq(priority=0, at=0.0305)
    model.submit(urgent, 0.0305)
    # Immediately: the later of the two equal victims goes back to the queue, tokens kept.
    assert (phase(urgent), phase(late), phase(early)) == (
        Phase.PREFILL,
        Phase.WAITING,
        Phase.DECODE,
    )
    assert (model.running, model.waiting, model.preemptions) == (2, 1, 1)
    assert late.preemptions == 1
    assert model.generated(late) == late.resumed_tokens == 11
    assert model.held_tokens() == (10 + 11) + 10
    assert model.snapshot().generation_tokens == 2 * 11

    model.advance(0.051)
    assert ttft(urgent) == pytest.approx(ttft(probe))
    assert phase(late) is Phase.WAITING

    # early finishes at step 49, 20 ms + 49 ms; late takes its slot and recomputes its
    # prompt and its 11 tokens: 10 + 21 * 1 ms, then its 12th token comes out.
    model.advance(0.0691)
    assert phase(late) is Phase.PREFILL
    assert model.generated(late) == 11
    assert model.held_tokens() == (10 + model.generated(urgent)) + (10 + 11)
    model.advance(0.0690 + 0.031 - 0.0002)
    assert model.generated(late) == 11
    model.advance(0.0690 + 0.031 + 0.0002)
    assert phase(late) is Phase.DECODE
    assert model.generated(late) == 12

    drain(model)
    assert late.finished_at is not None
    # 38 steps of 1 ms after its 12th token (fewer than the 49 of a fresh start).
    assert late.finished_at == pytest.approx(0.0690 + 0.031 + 0.038, abs=0.0015)
    assert ttft(late) == pytest.approx(ttft(early))  # observed once, before the preemption
    assert model.prompt_tokens == 3 * 10
    assert model.preemptions == 1
    assert_idle_and_exact(model, [early, late, urgent])


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [
        ((3, 3), 1),  # a tie: the latest arrival
        ((5, 3), 0),  # the worst priority, though it came first
        ((3, 5), 1),
    ],
)
def test_the_victim_is_the_worst_priority_then_the_latest_arrival(
    priorities: tuple[int, int], victim: int
) -> None:
    model = priority_model()
    running = [seq(priority=p) for p in priorities]
    for s in running:
        model.submit(s, 0.0)
    model.advance(0.025)
    model.submit(seq(priority=1, at=0.025), 0.025)
    assert [s.phase is Phase.WAITING for s in running] == [i == victim for i in range(2)]
    assert model.preemptions == 1


def test_several_urgent_arrivals_preempt_several_and_all_finish_exactly() -> None:
    model = priority_model(slots=3)
    background = [seq(priority=9, tokens=40) for _ in range(3)]
    for s in background:
        model.submit(s, 0.0)
    model.advance(0.025)
    urgent = [seq(priority=p, tokens=20, at=0.025) for p in (0, 1)]
    for s in urgent:
        model.submit(s, 0.025)
    assert [phase(s) for s in background] == [Phase.DECODE, Phase.WAITING, Phase.WAITING]
    assert model.preemptions == 2
    drain(model)
    assert_idle_and_exact(model, [*background, *urgent])


@pytest.mark.parametrize("priority", [2, 7])
def test_an_equal_or_worse_arrival_preempts_nothing(priority: int) -> None:
    model = priority_model(slots=1)
    running = seq(priority=2)
    model.submit(running, 0.0)
    model.advance(0.025)
    newcomer = seq(priority=priority, at=0.025)
    model.submit(newcomer, 0.025)
    assert (phase(running), phase(newcomer)) == (Phase.DECODE, Phase.WAITING)
    assert model.preemptions == 0
    drain(model)
    assert model.preemptions == 0
    assert_idle_and_exact(model, [running, newcomer])


def test_a_prompt_that_does_not_fit_in_free_kv_tokens_preempts() -> None:
    model = priority_model(slots=8, kv_capacity_tokens=100)
    low = seq(prompt=60, tokens=30, priority=1)
    model.submit(low, 0.0)
    model.advance(0.0755)  # prefill of 70 ms, then five steps: 66 tokens held
    assert model.held_tokens() == 66
    high = seq(prompt=60, tokens=10, priority=0, at=0.075)
    model.submit(high, 0.075)
    assert (phase(low), phase(high), model.preemptions) == (Phase.WAITING, Phase.PREFILL, 1)
    assert model.held_tokens() == 60
    drain(model)
    assert low.resumed_tokens == 6
    assert_idle_and_exact(model, [low, high])


def test_preemption_during_prefill_keeps_one_time_to_first_token() -> None:
    model = priority_model(slots=1)
    low = seq(priority=1)
    model.submit(low, 0.0)
    model.advance(0.005)  # in its prefill
    high = seq(priority=0, at=0.005)
    model.submit(high, 0.005)
    assert (phase(low), model.generated(low), low.resumed_tokens) == (Phase.WAITING, 0, 0)
    model.advance(0.021)  # low's old prefill end (20 ms) passes: it is stale
    assert phase(low) is Phase.WAITING
    assert low.first_token_at is None
    drain(model)
    assert ttft(low) > ttft(high)
    assert_idle_and_exact(model, [low, high])


def test_a_preempted_request_that_leaves_counts_the_tokens_it_had_sent() -> None:
    model = priority_model(slots=1)
    low = seq(priority=1)
    model.submit(low, 0.0)
    model.advance(0.0255)  # five steps after its first token: 6 tokens
    high = seq(priority=0, tokens=5, at=0.0255)
    model.submit(high, 0.0255)
    model.abort(low, 0.03)
    assert (phase(low), model.waiting) == (Phase.ABORTED, 0)
    drain(model)
    assert (model.running, model.waiting, model.held_tokens()) == (0, 0, 0)
    assert model.snapshot().generation_tokens == 6 + 5


def test_the_prefix_cache_serves_a_resumed_prompt() -> None:
    model = priority_model(slots=1, prefix_cache_blocks=100)
    words = [f"w{i}" for i in range(40)]
    low = seq(prompt=40, tokens=30, priority=1, hashes=block_hashes(words, 16))
    model.submit(low, 0.0)
    model.advance(0.0555)  # prefill of 50 ms, then five steps: 6 tokens
    high = seq(prompt=10, tokens=2, priority=0, at=0.0555)
    model.submit(high, 0.0555)
    model.advance(0.0556 + 0.020 + 0.001)  # high: prefill of 20 ms and one step
    assert phase(high) is Phase.DONE
    resumed_at = model.next_event_at()
    assert phase(low) is Phase.PREFILL
    assert resumed_at is not None
    # Its prompt's two full blocks (32 tokens) come from the cache: 8 + 6 tokens recomputed.
    start = high.finished_at
    assert start is not None
    assert resumed_at == pytest.approx(start + (10 + 14) / 1000)
    assert low.cached_tokens == 0  # usage keeps the first admission's count
    assert model.prefix_cache_hits == 32
    assert model.prefix_cache_queries == 40 + 10 + 46
    drain(model)
    assert_idle_and_exact(model, [low, high])


def test_preemptions_are_published_under_vllms_name() -> None:
    model = priority_model(slots=1)
    model.submit(seq(priority=1), 0.0)
    model.advance(0.025)
    model.submit(seq(priority=0, at=0.025), 0.025)
    text = render(model.snapshot(), "m")
    assert "# TYPE vllm:num_preemptions_total counter" in text
    assert 'vllm:num_preemptions_total{model_name="m",engine="0"} 1.0' in text
