"""Continuous batching as a discrete-event model: slots, a queue, prefill, decode steps.

The model holds no clock and starts no task: the caller passes the time to every call and
asks ``next_event_at()`` when to call ``advance`` again. ``engine.EngineLoop`` drives it
with one timer on the event loop; unit tests drive it with made-up times, so its timing is
exact and deterministic there.

The life of one request (a ``Sequence``), with every duration in ``docs/simulator.md``:

1. It waits until a slot is free and its prompt fits in the free KV tokens. The queue is in
   arrival order; with ``priority_scheduling`` (vLLM's ``--scheduling-policy priority``) it
   is in (``priority``, arrival) order, lower priority values first.
2. With ``priority_scheduling``, a waiting request that cannot start preempts running ones
   of a strictly worse (higher) priority, the worst first and of those the latest arrival
   first, until it fits or none is left. A preempted request goes back to the queue at its
   old place and keeps the tokens it had sent (vLLM's recompute mode).
3. Prefill: ``ttft_ms + prefill_ms_per_token * uncached prompt tokens`` (+ ``delay_ms`` of a
   directive). Prefills run side by side and are not slowed by the decode batch, as chunked
   prefill keeps time to first token close to that. The first output token comes out at its
   end. A preempted request is prefilled again over its prompt and the tokens it had sent
   (the prefix cache may hit its prompt), and its next token comes out at the end; time to
   first token and queue time are observed on the first admission only.
4. Decode: one engine step loop for all running sequences; each step gives every decoding
   sequence one token and lasts ``itl_ms * (1 + itl_growth * running / slots)``, where
   ``running`` counts every slot holder (prefilling or decoding).
5. It leaves its slot when its last token is out; the next waiting request starts at once.

Steps cost O(1) plus the sequences that finish: a decoding sequence's token count is derived
from the global step counter, not incremented one by one. With priority scheduling, a step
whose queue head cannot start scans the slot holders once for a request to preempt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from backfill.simulator.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineSnapshot,
    Histogram,
)
from backfill.simulator.prefix_cache import PrefixCache


@dataclass(frozen=True)
class BatchingConfig:
    slots: int
    ttft_ms: float = 50.0
    prefill_ms_per_token: float = 0.0
    itl_ms: float = 1.0
    itl_growth: float = 0.0
    kv_capacity_tokens: int = 262_144
    block_tokens: int = 16
    prefix_cache_blocks: int = 0
    """0 turns the prefix cache off."""
    priority_scheduling: bool = False
    """vLLM's ``--scheduling-policy priority``; False is ``fcfs``, where every request must
    have priority 0."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if min(self.ttft_ms, self.prefill_ms_per_token, self.itl_ms, self.itl_growth) < 0:
            raise ValueError("times and itl_growth must not be negative")
        if self.kv_capacity_tokens < 1 or self.block_tokens < 1 or self.prefix_cache_blocks < 0:
            raise ValueError("kv_capacity_tokens and block_tokens must be at least 1")


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Times are in seconds of the caller's clock."""

    prompt_tokens: int
    max_tokens: int
    """Output tokens this request will generate (0 is allowed: the answer is empty)."""
    arrived_at: float
    block_hashes: tuple[int, ...] = ()
    extra_prefill_s: float = 0.0
    finish_reason: str = "length"
    phase: Phase = Phase.WAITING
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    priority: int = 0
    """vLLM's request priority: lower values are served first (priority scheduling only)."""
    join_step: int = 0
    """The global step count when it (last) started decoding; it has
    ``resumed_tokens + 1`` tokens then."""
    resumed_tokens: int = 0
    """Output tokens that were out when it was last preempted; they are kept, so it is
    prefilled again over prompt and these tokens, then generates the rest."""
    preemptions: int = 0
    arrival: int = 0
    """Submission order, set by ``submit``: ties of priority go by it."""
    entry: int = -1
    """The tie-breaker of its live prefill or decode heap entry; older entries are stale."""


@dataclass
class Progress:
    """What one ``advance`` changed, for the caller to wake whoever waits."""

    first_tokens: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    """Preempted sequences whose prefill ended again: one more token is out."""
    finished: list[Sequence] = field(default_factory=list)
    steps: int = 0


class BatchingModel:
    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self.cache = (
            PrefixCache(config.block_tokens, config.prefix_cache_blocks)
            if config.prefix_cache_blocks > 0
            else None
        )
        # Heap of (priority, arrival, seq); an aborted waiter stays and is skipped when it
        # comes to the top. _waiters counts the live ones.
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._waiters = 0
        self._arrivals = itertools.count()
        self._holders: set[Sequence] = set()
        # Heaps: (prefill end time, tie-breaker, seq) and (finish step, tie-breaker, seq).
        # A sequence aborted or preempted in the middle stays in its heap and is skipped when
        # popped: its phase or its ``entry`` no longer match.
        self._prefill: list[tuple[float, int, Sequence]] = []
        self._decode: list[tuple[int, int, Sequence]] = []
        self._order = itertools.count()
        self._steps = 0
        self._next_step_at: float | None = None
        # Running sums that make token counts O(1): see held_tokens().
        self._held_prompt = 0
        self._decoding = 0
        self._decoding_join_sum = 0
        self.peak_running = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.preemptions = 0
        # Output tokens counted for good: of finished, aborted and preempted runs.
        self._generated_done = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)

    # ---- what the caller reads -------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._holders)

    @property
    def waiting(self) -> int:
        return self._waiters

    def generated(self, seq: Sequence) -> int:
        """Output tokens of ``seq`` that are out, as of the last ``advance``."""
        if seq.phase is Phase.DECODE:
            return seq.resumed_tokens + 1 + self._steps - seq.join_step
        if seq.phase is Phase.DONE:
            return seq.max_tokens
        if seq.phase in (Phase.WAITING, Phase.PREFILL):
            return seq.resumed_tokens  # 0 unless it was preempted
        return 0

    def held_tokens(self) -> int:
        """Prompt and output tokens of every slot holder: what their KV cache holds."""
        # _held_prompt sums each holder's prefilled tokens (prompt and resumed_tokens);
        # the rest are the tokens decoded since it joined, one per step plus the first.
        decoded = self._decoding * (1 + self._steps) - self._decoding_join_sum
        return self._held_prompt + decoded

    def kv_cache_usage(self) -> float:
        return min(1.0, self.held_tokens() / self.config.kv_capacity_tokens)

    def step_s(self) -> float:
        c = self.config
        return c.itl_ms * (1 + c.itl_growth * self.running / c.slots) / 1000

    def next_event_at(self) -> float | None:
        """When ``advance`` has something to do next, or None while the engine is idle."""
        times = [t for t in (self._next_step_at,) if t is not None]
        if self._prefill:
            times.append(self._prefill[0][0])
        return min(times) if times else None

    def snapshot(self) -> EngineSnapshot:
        live = self.held_tokens() - self._held_prompt
        return EngineSnapshot(
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage=self.kv_cache_usage(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self._generated_done + live,
            preemptions=self.preemptions,
            finished=dict(self.finished),
            ttft=self.ttft,
            e2e_latency=self.e2e_latency,
            queue_time=self.queue_time,
        )

    # ---- what the caller does --------------------------------------------------------------

    def submit(self, seq: Sequence, now: float) -> Progress:
        """Queue ``seq`` (arrived at ``now``) and start it if a slot is free (or, with
        priority scheduling, once running requests of a worse priority are preempted)."""
        if seq.priority != 0 and not self.config.priority_scheduling:
            raise ValueError(f"Got priority {seq.priority} but Priority scheduling is not enabled.")
        progress = self.advance(now)
        seq.arrival = next(self._arrivals)
        self._enqueue(seq)
        self._admit(now)
        return progress

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop ``seq`` wherever it is (its client went away) and free its slot."""
        if seq.phase is Phase.WAITING:
            self._waiters -= 1  # its heap entry is skipped when it comes to the top
        elif seq.phase in (Phase.PREFILL, Phase.DECODE):
            self._generated_done += self.generated(seq) - seq.resumed_tokens
            self._release(seq)
        else:
            return
        seq.phase = Phase.ABORTED
        self._admit(now)

    def advance(self, now: float) -> Progress:
        """Run every prefill end and decode step due at or before ``now``, in time order."""
        progress = Progress()
        while True:
            step_at = self._next_step_at if self._next_step_at is not None else float("inf")
            prefill_at = self._prefill[0][0] if self._prefill else float("inf")
            if min(step_at, prefill_at) > now:
                return progress
            if step_at <= prefill_at:
                self._step(step_at, progress)
            else:
                _, entry, seq = heapq.heappop(self._prefill)
                if seq.phase is Phase.PREFILL and seq.entry == entry:
                    self._first_token(seq, prefill_at, progress)

    # ---- inside ----------------------------------------------------------------------------

    @staticmethod
    def _prefill_tokens(seq: Sequence) -> int:
        """What its prefill computes and its KV cache then holds: prompt and resumed tokens."""
        return seq.prompt_tokens + seq.resumed_tokens

    def _enqueue(self, seq: Sequence) -> None:
        seq.phase = Phase.WAITING
        # In fcfs every priority is 0: the heap is in arrival order, a FIFO.
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._waiters += 1

    def _first_waiting(self) -> Sequence | None:
        while self._waiting:
            seq = self._waiting[0][2]
            if seq.phase is Phase.WAITING:
                return seq
            heapq.heappop(self._waiting)  # aborted while it waited
        return None

    def _fits(self, seq: Sequence) -> bool:
        c = self.config
        if self.running >= c.slots:
            return False
        # A prompt waits for free KV tokens, except on an idle engine (it would never fit).
        need = self._prefill_tokens(seq)
        return not self._holders or self.held_tokens() + need <= c.kv_capacity_tokens

    def _admit(self, now: float) -> None:
        while (seq := self._first_waiting()) is not None:
            if not self._fits(seq):
                if not self.config.priority_scheduling or not self._preempt_for(seq):
                    return
                continue
            heapq.heappop(self._waiting)
            self._waiters -= 1
            self._start_prefill(seq, now)

    def _preempt_for(self, seq: Sequence) -> bool:
        """Preempt the worst running request if its priority is worse than ``seq``'s."""
        if not self._holders:
            return False
        victim = max(self._holders, key=lambda h: (h.priority, h.arrival))
        if victim.priority <= seq.priority:
            return False
        out = self.generated(victim)
        self._generated_done += out - victim.resumed_tokens
        self._release(victim)
        victim.resumed_tokens = out
        victim.preemptions += 1
        self.preemptions += 1
        self._enqueue(victim)
        return True

    def _start_prefill(self, seq: Sequence, now: float) -> None:
        c = self.config
        tokens = self._prefill_tokens(seq)
        cached = 0
        if self.cache is not None:
            cached = self.cache.lookup(seq.block_hashes, seq.prompt_tokens)
            self.prefix_cache_queries += tokens
            self.prefix_cache_hits += cached
        if seq.admitted_at is None:
            # What usage reports, as vLLM keeps the first count; the queue time is observed
            # once too.
            seq.cached_tokens = cached
            seq.admitted_at = now
            self.queue_time.observe(now - seq.arrived_at)
        duration = (
            c.ttft_ms + c.prefill_ms_per_token * (tokens - cached)
        ) / 1000 + seq.extra_prefill_s
        seq.phase = Phase.PREFILL
        self._holders.add(seq)
        self._held_prompt += tokens
        self.peak_running = max(self.peak_running, self.running)
        seq.entry = next(self._order)
        heapq.heappush(self._prefill, (now + duration, seq.entry, seq))

    def _first_token(self, seq: Sequence, now: float, progress: Progress) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.ttft.observe(now - seq.arrived_at)
            self.prompt_tokens += seq.prompt_tokens
            progress.first_tokens.append(seq)
        else:
            progress.resumed.append(seq)  # a preempted request's next token
        if self.cache is not None:
            self.cache.insert(seq.block_hashes)
        left = seq.max_tokens - seq.resumed_tokens  # this token included
        if left <= 1 or self.config.itl_ms == 0:
            # Nothing left to decode, or decode steps take no time: all tokens are out now.
            self._finish(seq, now, progress)
            return
        seq.phase = Phase.DECODE
        seq.join_step = self._steps
        self._decoding += 1
        self._decoding_join_sum += seq.join_step
        finish_step = self._steps + left - 1
        seq.entry = next(self._order)
        heapq.heappush(self._decode, (finish_step, seq.entry, seq))
        if self._next_step_at is None:
            self._next_step_at = now + self.step_s()

    def _step(self, now: float, progress: Progress) -> None:
        self._steps += 1
        progress.steps += 1
        while self._decode and self._decode[0][0] <= self._steps:
            _, entry, seq = heapq.heappop(self._decode)
            if seq.phase is Phase.DECODE and seq.entry == entry:
                self._finish(seq, now, progress)
        self._admit(now)
        self._next_step_at = now + self.step_s() if self._decoding else None

    def _finish(self, seq: Sequence, now: float, progress: Progress) -> None:
        self._release(seq)
        seq.phase = Phase.DONE
        seq.finished_at = now
        self._generated_done += seq.max_tokens - seq.resumed_tokens
        self.finished[seq.finish_reason] += 1
        self.e2e_latency.observe(now - seq.arrived_at)
        progress.finished.append(seq)
        self._admit(now)

    def _release(self, seq: Sequence) -> None:
        self._holders.discard(seq)
        self._held_prompt -= self._prefill_tokens(seq)
        if seq.phase is Phase.DECODE:
            self._decoding -= 1
            self._decoding_join_sum -= seq.join_step
            if not self._decoding:
                # Only stale entries can be left; no step runs until someone decodes again.
                self._decode.clear()
                self._next_step_at = None
