"""Continuous batching as vLLM V1's scheduler does it, as a discrete-event model.

The model holds no clock and starts no task: the caller passes the time to every call and
asks ``next_event_at()`` when to call ``advance`` again. ``engine.EngineLoop`` drives it
with one timer on the event loop; unit tests drive it with made-up times, so its timing is
exact and deterministic there. ``docs/simulator.md`` has every rule and formula; they follow
``Scheduler.schedule()`` in ``vllm/v1/core/sched/scheduler.py`` (vLLM 0.32).

The life of one request (a ``Sequence``):

1. ``ttft_ms`` after ``submit`` (the API server's own work) it joins the waiting queue:
   FIFO under fcfs, by (``priority``, arrival) under the priority policy.
2. Engine steps run back to back while there is work. Each step first schedules the running
   requests (a decoding one: 1 token; one still prefilling: its next chunk), then, if no
   request was preempted in this step, waiting ones from the head of the queue while a slot
   is free (``running < slots``), the token budget ``max_num_batched_tokens`` is not spent
   and the head's KV blocks can be allocated; the first head that cannot start ends the
   waiting loop (it preempts nothing).
3. A running request that cannot get the KV blocks for its next token(s) preempts one
   running request after another until they fit: under the priority policy the worst
   (priority, arrival), under fcfs the last one scheduled. If it is itself the victim, no
   more running requests are scheduled in this step. A victim frees its blocks, goes back to
   the waiting queue (fcfs: at its front) and keeps the tokens it had sent; it is prefilled
   again over prompt and those tokens later (recompute).
4. A step lasts ``itl_ms * (1 + itl_growth * max(0, scheduled - itl_knee) / slots) +
   prefill_ms_per_token * prefill tokens in it``. A request's first token comes at the end
   of the step that completes its prefill; each later step gives each decoding request one
   token.

Cost: a step is O(1) plus its prefill chunks, admissions and finishers while the free KV
blocks cover every decoding request's next block. Decoding requests move in lockstep, so a
decoder's token count is derived from a global step counter, and the decoders that start a
new block in a step are counted in aggregate (by their position modulo the block size).
Only near a full KV cache does a step walk the decoders one by one to allocate and preempt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from backfill.simulator.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineSnapshot,
    Histogram,
)
from backfill.simulator.prefix_cache import PrefixCache

StepProfileName = Literal["flat", "steep"]


@dataclass(frozen=True)
class StepProfile:
    """Presets of the four timing options (milliseconds; ``itl_growth`` is a factor)."""

    ttft_ms: float
    itl_ms: float
    itl_growth: float
    prefill_ms_per_token: float


STEP_PROFILES: dict[StepProfileName, StepProfile] = {
    # Memory-bound decode, as on a GPU with a small batch: a step barely grows with the batch.
    "flat": StepProfile(ttft_ms=5, itl_ms=10, itl_growth=0.1, prefill_ms_per_token=0.02),
    # Fitted to the real vLLM CPU engine (SmolLM2-135M, bf16, 2 cores, 16 slots), measured as
    # tests/vllm/test_simulator_agrees.py calibrates: a step of 27 ms with one sequence, each
    # more adding 1.5 ms (27 * (1 + 0.89 * n / 16)), and 1.0 ms per prefilled prompt token.
    # The growth is relative to running / slots: with another --slots it scales differently.
    "steep": StepProfile(ttft_ms=5, itl_ms=27, itl_growth=0.89, prefill_ms_per_token=1.0),
}


@dataclass(frozen=True)
class BatchingConfig:
    slots: int
    """vLLM's ``--max-num-seqs``: requests running at once."""
    ttft_ms: float = 50.0
    """Fixed latency before a request reaches the waiting queue (the API server's work)."""
    prefill_ms_per_token: float = 0.0
    itl_ms: float = 1.0
    """A step's base time. 0: decode takes no time (all tokens come with the first)."""
    itl_growth: float = 0.0
    itl_knee: int = 0
    """Sequences a step holds at ``itl_ms``: only those past it slow the step (a CPU whose
    step stays flat while memory, not compute, bounds it). 0: every sequence does."""
    kv_capacity_tokens: int = 262_144
    block_tokens: int = 16
    prefix_cache_blocks: int = 0
    """0 turns the prefix cache off."""
    priority_scheduling: bool = False
    """vLLM's ``--scheduling-policy priority``; False is ``fcfs``, which ignores priority."""
    max_num_batched_tokens: int = 2048
    """vLLM's token budget of one step (chunked prefill)."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if min(self.ttft_ms, self.prefill_ms_per_token, self.itl_ms, self.itl_growth) < 0:
            raise ValueError("times and itl_growth must not be negative")
        if not 0 <= self.itl_knee <= self.slots:
            raise ValueError("itl_knee must be between 0 and slots")
        if self.kv_capacity_tokens < 1 or self.block_tokens < 1 or self.prefix_cache_blocks < 0:
            raise ValueError("kv_capacity_tokens and block_tokens must be at least 1")
        if self.kv_capacity_tokens < self.block_tokens:
            raise ValueError("kv_capacity_tokens must hold at least one block of block_tokens")
        if self.max_num_batched_tokens < self.slots:
            # vLLM's own check (SchedulerConfig), in its words.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.slots})."
            )

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_tokens

    def step_s(self, scheduled: int, prefill_tokens: int) -> float:
        """How long a step with ``scheduled`` requests and ``prefill_tokens`` lasts."""
        return (
            self.itl_ms * (1 + self.itl_growth * max(0, scheduled - self.itl_knee) / self.slots)
            + self.prefill_ms_per_token * prefill_tokens
        ) / 1000


class Phase(Enum):
    WAITING = "waiting"
    """Not running: on its way to the queue (``ttft_ms``), in it, or preempted."""
    PREFILL = "prefill"
    """Running (holds a slot), its prompt (and kept tokens) not all computed yet."""
    DECODE = "decode"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. Times are in seconds of the caller's clock."""

    prompt_tokens: int
    max_tokens: int
    """Output tokens this request will generate (0 is allowed: the answer is empty)."""
    arrived_at: float
    block_hashes: tuple[int, ...] = ()
    extra_prefill_s: float = 0.0
    """A ``delay_ms`` directive: once it holds a slot, its first chunk waits this long."""
    finish_reason: str = "length"
    phase: Phase = Phase.WAITING
    cached_tokens: int = 0
    queued_at: float | None = None
    """When it reached the waiting queue, ``ttft_ms`` after its arrival."""
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    priority: int = 0
    """vLLM's request priority: lower values are served first (priority policy only)."""
    resumed_tokens: int = 0
    """Output tokens that were out when it was last preempted; they are kept, so it is
    prefilled again over prompt and these tokens, then generates the rest."""
    preemptions: int = 0
    arrival: int = 0
    """Submission order, set by ``submit``: ties of priority go by it."""
    computed: int = 0
    """KV tokens computed (prefix-cache hits included) while it is not decoding."""
    looked_up: bool = False
    """Whether this admission's prefix-cache lookup was done."""
    ready_at: float = 0.0
    """A delayed request's first chunk is not scheduled before this time."""
    join_base: int = 0
    """While decoding, its computed tokens are ``join_base + model steps``."""
    finish_step: int = 0
    entry: int = -1
    """The tie-breaker of its live decode heap entry; older entries are stale."""
    sched_step: int = -1
    """The scheduling pass that scheduled it one by one (a step near full KV)."""
    last_token_at: float = 0.0
    """When its last token came out, kept where that was not at the step's start."""


@dataclass
class Progress:
    """What one ``advance`` changed, for the caller to wake whoever waits."""

    first_tokens: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    """Preempted sequences whose prefill ended again: one more token is out."""
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    steps: int = 0


_INF = float("inf")


class BatchingModel:
    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self.cache = (
            PrefixCache(config.block_tokens, config.prefix_cache_blocks)
            if config.prefix_cache_blocks > 0
            else None
        )
        self._block = config.block_tokens
        self._kv_blocks = config.kv_blocks
        self._used = 0
        """KV blocks held by running requests (those of this step's tokens included)."""
        self._arrival_order = itertools.count()
        self._order = itertools.count()
        # (time it reaches the queue, order, seq): requests within their ttft_ms.
        self._arrivals: list[tuple[float, int, Sequence]] = []
        # The waiting queue; aborted requests stay in it and are skipped at its head.
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, int, Sequence]] = []
        self._waiters = 0
        # Running requests in the order they were scheduled (vLLM's self.running), and of
        # them those not decoding (prefilling, or waiting out a delay).
        self._running: dict[Sequence, None] = {}
        self._prefilling: dict[Sequence, None] = {}
        self._delayed: list[tuple[float, int, Sequence]] = []
        # Decoding requests in aggregate: how many, Σ(join_base - prompt - resumed + 1)
        # (their generated tokens of this run are that plus count * steps), and how many
        # have each join_base modulo the block size.
        self._decoding = 0
        self._decoding_base = 0
        self._by_phase = [0] * self._block
        self._decode: list[tuple[int, int, Sequence]] = []  # (finish step, entry, seq)
        # Decoders whose last token did not come at the current step's start.
        self._irregular: dict[Sequence, None] = {}
        self._steps = 0
        # The step being run: set while scheduling it and until it ends.
        self._stepping = False
        self._pass = 0
        self._step_start = 0.0
        self._step_end: float | None = None
        self._all_decoders = True
        self._step_decoders = 0
        self._step_prefill = 0
        self._step_preemptions = 0
        self._budget = 0
        self._chunks: dict[Sequence, int] = {}
        self._wake: float | None = None
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
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)

    # ---- what the caller reads -------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return self._waiters

    @property
    def steps(self) -> int:
        """Engine steps that ended."""
        return self._steps

    def generated(self, seq: Sequence) -> int:
        """Output tokens of ``seq`` that are out, as of the last ``advance``."""
        if seq.phase is Phase.DECODE:
            return seq.join_base + self._steps - seq.prompt_tokens + 1
        if seq.phase is Phase.DONE:
            return seq.max_tokens
        if seq.phase is Phase.ABORTED:
            return 0
        return seq.resumed_tokens  # 0 unless it was preempted

    def used_blocks(self) -> int:
        """KV blocks of the running requests: ceil(computed or computing tokens / block)."""
        return self._used

    def free_blocks(self) -> int:
        """May be negative while a request too large for the cache runs alone."""
        return self._kv_blocks - self._used

    def kv_cache_usage(self) -> float:
        return min(1.0, self._used / self._kv_blocks)

    def next_event_at(self) -> float | None:
        """When ``advance`` has something to do next, or None while the engine is idle."""
        when = self._step_end if self._step_end is not None else _INF
        if self._arrivals and self._arrivals[0][0] < when:
            when = self._arrivals[0][0]
        if not self._stepping:
            if self._delayed and self._delayed[0][0] < when:
                when = self._delayed[0][0]
            if self._wake is not None and self._wake < when:
                when = self._wake
        return None if when == _INF else when

    def snapshot(self) -> EngineSnapshot:
        live = self._decoding_base + self._decoding * self._steps
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
            inter_token_latency=self.inter_token_latency,
            decode_time=self.decode_time,
            iteration_tokens=self.iteration_tokens,
        )

    # ---- what the caller does --------------------------------------------------------------

    def submit(self, seq: Sequence, now: float) -> None:
        """Take ``seq`` (arrived at ``now``): it reaches the waiting queue ``ttft_ms`` later,
        in ``advance``. Requests submitted for the same time reach it together.

        Under fcfs its ``priority`` is ignored, as vLLM ignores it."""
        seq.arrival = next(self._arrival_order)
        seq.phase = Phase.WAITING
        at = now + self.config.ttft_ms / 1000
        heapq.heappush(self._arrivals, (at, seq.arrival, seq))

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop ``seq`` wherever it is (its client went away) and free its slot."""
        if seq.phase is Phase.WAITING:
            if seq.queued_at is not None:
                self._waiters -= 1  # its queue entry is skipped when it comes to the head
        elif seq.phase in (Phase.PREFILL, Phase.DECODE):
            self._generated_done += self.generated(seq) - seq.resumed_tokens
            self._release(seq)
            if not self._stepping:
                self._wake = now  # a slot is free: an idle engine looks at its queue
        else:
            return
        seq.phase = Phase.ABORTED

    def advance(self, now: float) -> Progress:
        """Run every arrival, step end and wake-up due at or before ``now``, in time order.
        At equal times arrivals come first, so they are seen by the next step."""
        progress = Progress()
        while True:
            step_at = self._step_end if self._step_end is not None else _INF
            arrival_at = self._arrivals[0][0] if self._arrivals else _INF
            wake_at = _INF
            if not self._stepping:
                if self._delayed:
                    wake_at = self._delayed[0][0]
                if self._wake is not None and self._wake < wake_at:
                    wake_at = self._wake
            at = min(step_at, arrival_at, wake_at)
            if at > now:
                return progress
            if arrival_at == at:
                while self._arrivals and self._arrivals[0][0] <= at:
                    seq = heapq.heappop(self._arrivals)[2]
                    if seq.phase is Phase.WAITING:
                        seq.queued_at = at
                        self._enqueue(seq)
                if not self._stepping:
                    self._start_step(at, progress)
            elif step_at == at:
                self._end_step(at, progress)
                self._start_step(at, progress)
            else:
                self._wake = None
                while self._delayed and self._delayed[0][0] <= at:
                    heapq.heappop(self._delayed)
                self._start_step(at, progress)

    # ---- the waiting queue -----------------------------------------------------------------

    def _enqueue(self, seq: Sequence) -> None:
        if self.config.priority_scheduling:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))
        else:
            self._fifo.append(seq)
        self._waiters += 1

    def _requeue(self, seq: Sequence) -> None:
        """A preempted request: fcfs puts it at the front (vLLM's ``prepend_request``)."""
        if self.config.priority_scheduling:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))
        else:
            self._fifo.appendleft(seq)
        self._waiters += 1

    def _head(self) -> Sequence | None:
        if self.config.priority_scheduling:
            while self._heap:
                seq = self._heap[0][2]
                if seq.phase is Phase.WAITING:
                    return seq
                heapq.heappop(self._heap)  # aborted while it waited
            return None
        while self._fifo:
            seq = self._fifo[0]
            if seq.phase is Phase.WAITING:
                return seq
            self._fifo.popleft()
        return None

    def _pop_head(self) -> None:
        if self.config.priority_scheduling:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._waiters -= 1

    # ---- one step --------------------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self._block)

    def _start_step(self, now: float, progress: Progress) -> None:
        """Schedule a step at ``now`` (vLLM's ``schedule()``), or stay idle if none can run."""
        if self._stepping:
            return
        c = self.config
        self._stepping = True
        self._pass += 1
        self._step_start = now
        self._step_decoders = 0
        self._step_prefill = 0
        self._step_preemptions = 0
        self._budget = c.max_num_batched_tokens
        stop = False
        # The running requests first: every decoder one token, then the prefill chunks.
        # (vLLM goes through them in one list; a decoder never stands behind a prefill that
        # is cut short by the budget, save right after a preemption or a delay.)
        if self._decoding:
            need = self._by_phase[-self._steps % self._block]
            if need <= self._kv_blocks - self._used:
                self._used += need
                self._all_decoders = True
                self._step_decoders = self._decoding
                self._budget -= self._decoding
            else:
                self._all_decoders = False
                stop = self._schedule_decoders(now, progress)
        else:
            self._all_decoders = True
        if self._prefilling and not stop:
            stop = self._schedule_prefills(now, progress)
        if not self._step_preemptions:
            self._schedule_waiting(now)
        scheduled = self._step_decoders + len(self._chunks)
        if scheduled:
            self._step_end = now + c.step_s(scheduled, self._step_prefill)
        elif self._step_preemptions:
            self._step_end = now  # nothing ran, but preemptions changed what can: go again
        else:
            self._stepping = False

    def _schedule_decoders(self, now: float, progress: Progress) -> bool:
        """Near full KV: allocate each decoder's next block in running order, preempting
        where it does not fit. True if a request preempted itself (the step stops there)."""
        stop = False
        steps = self._steps
        block = self._block
        for seq in list(self._running):
            if seq.phase is not Phase.DECODE:
                continue  # a prefill, or preempted in this loop
            if stop:
                self._pause(seq, now)
                continue
            need = 1 if (seq.join_base + steps) % block == 0 else 0
            if need and not self._make_room(seq, need, now, progress):
                stop = True
                continue
            self._used += need
            seq.sched_step = self._pass
            self._step_decoders += 1
            self._budget -= 1
        return stop

    def _schedule_prefills(self, now: float, progress: Progress) -> bool:
        for seq in list(self._prefilling):
            if self._budget <= 0:
                break
            if seq.phase is not Phase.PREFILL or seq.ready_at > now:
                continue  # preempted in this loop, or waiting out its delay
            if not seq.looked_up:
                self._look_up(seq)
            left = seq.prompt_tokens + seq.resumed_tokens - seq.computed
            chunk = min(left, self._budget)
            need = self._blocks(seq.computed + chunk) - self._blocks(seq.computed)
            if need and not self._make_room(seq, need, now, progress):
                return True
            seq.extra_prefill_s = 0.0
            self._used += need
            self._chunks[seq] = chunk
            self._budget -= chunk
            self._step_prefill += chunk
        return False

    def _schedule_waiting(self, now: float) -> None:
        slots = self.config.slots
        while self._budget > 0 and len(self._running) < slots:
            seq = self._head()
            if seq is None:
                return
            if seq.extra_prefill_s > 0:
                # A delayed request takes its slot now and computes nothing until it is due.
                self._pop_head()
                self._admit(seq, now)
                seq.ready_at = now + seq.extra_prefill_s
                heapq.heappush(self._delayed, (seq.ready_at, next(self._order), seq))
                continue
            cached = (
                self.cache.match(seq.block_hashes, seq.prompt_tokens)
                if self.cache is not None
                else 0
            )
            chunk = min(seq.prompt_tokens + seq.resumed_tokens - cached, self._budget)
            need = self._blocks(cached + chunk)
            # No preemption for a waiting request. One larger than the whole cache starts
            # when no running request holds a block, and then runs over the cache.
            if need > self._kv_blocks - self._used and self._used:
                return
            self._pop_head()
            self._admit(seq, now)
            self._look_up(seq)
            self._used += need
            self._chunks[seq] = chunk
            self._budget -= chunk
            self._step_prefill += chunk

    def _admit(self, seq: Sequence, now: float) -> None:
        seq.phase = Phase.PREFILL
        self._running[seq] = None
        self._prefilling[seq] = None
        if len(self._running) > self.peak_running:
            self.peak_running = len(self._running)
        if seq.admitted_at is None:
            seq.admitted_at = now
            queued_at = seq.queued_at if seq.queued_at is not None else now
            self.queue_time.observe(now - queued_at)

    def _look_up(self, seq: Sequence) -> None:
        cached = 0
        if self.cache is not None:
            cached = self.cache.lookup(seq.block_hashes, seq.prompt_tokens)
            self.prefix_cache_queries += seq.prompt_tokens + seq.resumed_tokens
            self.prefix_cache_hits += cached
        if seq.preemptions == 0:
            seq.cached_tokens = cached  # usage reports the first admission's count, as vLLM
        seq.computed = cached
        seq.looked_up = True

    def _make_room(self, seq: Sequence, need: int, now: float, progress: Progress) -> bool:
        """Preempt until ``need`` more blocks are free for ``seq``; False if ``seq`` itself
        was preempted. A request that is the only one holding blocks may overrun the cache
        (it is larger than the cache: vLLM would have refused it)."""
        while need > self._kv_blocks - self._used and self._used > self._held(seq):
            if self.config.priority_scheduling:
                victim = max(self._running, key=lambda r: (r.priority, r.arrival))
            else:
                victim = next(reversed(self._running))
            self._preempt(victim, now, progress)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, now: float, progress: Progress) -> None:
        out = self.generated(seq)
        self._generated_done += out - seq.resumed_tokens
        if seq.phase is Phase.DECODE and seq not in self._irregular:
            seq.last_token_at = now  # its last token came at the end of the last step
        scheduled = self._scheduled(seq)
        self._release(seq)
        self._budget += scheduled
        seq.resumed_tokens = out
        seq.computed = 0
        seq.looked_up = False
        seq.preemptions += 1
        self.preemptions += 1
        self._step_preemptions += 1
        seq.phase = Phase.WAITING
        self._requeue(seq)
        progress.preempted.append(seq)

    def _pause(self, seq: Sequence, now: float) -> None:
        """A decoder that gets no token in this step: shift its join by one step."""
        block = self._block
        self._by_phase[seq.join_base % block] -= 1
        seq.join_base -= 1
        self._by_phase[seq.join_base % block] += 1
        self._decoding_base -= 1
        seq.finish_step += 1
        seq.entry = next(self._order)
        heapq.heappush(self._decode, (seq.finish_step, seq.entry, seq))
        if seq not in self._irregular:
            seq.last_token_at = now
            self._irregular[seq] = None

    def _held(self, seq: Sequence) -> int:
        """KV blocks of a running ``seq``, those of its tokens in this step included."""
        computed = seq.join_base + self._steps if seq.phase is Phase.DECODE else seq.computed
        return self._blocks(computed + self._scheduled(seq))

    def _scheduled(self, seq: Sequence) -> int:
        """Tokens of ``seq`` in the step being scheduled or run."""
        if not self._stepping:
            return 0
        if seq.phase is Phase.DECODE:
            return 1 if self._all_decoders or seq.sched_step == self._pass else 0
        return self._chunks.get(seq, 0)

    def _end_step(self, now: float, progress: Progress) -> None:
        duration = now - self._step_start
        regular = self._step_decoders
        if self._irregular:
            for seq in list(self._irregular):
                if self._scheduled(seq):
                    self.inter_token_latency.observe(now - seq.last_token_at)
                    del self._irregular[seq]
                    regular -= 1
        if regular:
            self.inter_token_latency.observe_many(duration, regular)
        step_tokens = self._step_decoders + self._step_prefill
        outputs = self._step_decoders > 0
        self._stepping = False
        self._step_end = None
        self._steps += 1
        progress.steps += 1
        if self._chunks:
            chunks, self._chunks = self._chunks, {}
            for seq, chunk in chunks.items():
                seq.computed += chunk
                if seq.computed >= seq.prompt_tokens + seq.resumed_tokens:
                    outputs = True
                    self._prefill_done(seq, now, progress)
        if outputs:
            # vLLM observes a step only when it produced a token (one IterationStats per
            # EngineCoreOutputs): a step of prompt chunks alone is not counted.
            self.iteration_tokens.observe(step_tokens)
        steps = self._steps
        while self._decode and self._decode[0][0] <= steps:
            _, entry, seq = heapq.heappop(self._decode)
            if seq.phase is Phase.DECODE and seq.entry == entry:
                self._finish(seq, now, progress)

    def _prefill_done(self, seq: Sequence, now: float, progress: Progress) -> None:
        del self._prefilling[seq]
        if self.cache is not None:
            self.cache.insert(seq.block_hashes)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.ttft.observe(now - seq.arrived_at)
            self.prompt_tokens += seq.prompt_tokens
            progress.first_tokens.append(seq)
        else:
            progress.resumed.append(seq)  # a preempted request's next token
            self.inter_token_latency.observe(now - seq.last_token_at)
        resumed = seq.resumed_tokens
        if resumed + 1 >= seq.max_tokens or self.config.itl_ms == 0:
            # Nothing left to decode, or decode steps take no time: all tokens are out now.
            self._finish(seq, now, progress)
            return
        seq.phase = Phase.DECODE
        steps = self._steps
        seq.join_base = seq.prompt_tokens + resumed - steps
        self._by_phase[seq.join_base % self._block] += 1
        self._decoding += 1
        self._decoding_base += 1 - steps
        seq.finish_step = steps + seq.max_tokens - resumed - 1
        seq.entry = next(self._order)
        heapq.heappush(self._decode, (seq.finish_step, seq.entry, seq))

    def _finish(self, seq: Sequence, now: float, progress: Progress) -> None:
        self._release(seq)
        seq.phase = Phase.DONE
        seq.finished_at = now
        self._generated_done += seq.max_tokens - seq.resumed_tokens
        self.finished[seq.finish_reason] += 1
        self.e2e_latency.observe(now - seq.arrived_at)
        first = seq.first_token_at
        self.decode_time.observe(now - first if first is not None else 0.0)
        progress.finished.append(seq)

    def _release(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running requests and free its blocks (and its place in
        the step being run)."""
        scheduled = self._scheduled(seq)
        if seq.phase is Phase.DECODE:
            computed = seq.join_base + self._steps
            if scheduled:
                self._step_decoders -= 1
            self._by_phase[seq.join_base % self._block] -= 1
            self._decoding -= 1
            self._decoding_base -= seq.join_base - seq.prompt_tokens - seq.resumed_tokens + 1
            self._irregular.pop(seq, None)
            if not self._decoding:
                self._decode.clear()  # only stale entries can be left
        else:
            computed = seq.computed
            if self._chunks.pop(seq, None) is not None:
                self._step_prefill -= scheduled
            self._prefilling.pop(seq, None)  # gone already if its prefill just ended
        self._used -= self._blocks(computed + scheduled)
        del self._running[seq]
