"""Whether a vLLM engine applies the request ``priority`` Backfill sends (docs/configuration.md).

vLLM started with ``--scheduling-policy fcfs`` (its default) takes a request's ``priority``
and ignores it: Backfill's batch requests then queue with people's instead of behind them, and
nothing in the answers says so. Only an experiment tells, so this one runs while the engine is
idle: hold every sequence slot with "filler" requests, queue two requests behind them, X of a
worse priority and then Y of a better one, and see which the engine serves first when a slot
frees. Arrival order (X) means the priority was ignored; Y means it was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import msgspec

from backfill.adapters.engines.pressure import Flavor, parse
from backfill.domain.engine_health import PriorityOutcome
from backfill.domain.scheduling.concurrency import Pressure

log = logging.getLogger("backfill.engines")

# How often /metrics is read while the probe waits for the engine to reach a state.
POLL_S = 0.02
# How long the fillers may take to hold every slot, and X and Y to be queued both.
SETTLE_TIMEOUT_S = 10.0
# X and Y are sent this far apart, so that X surely arrives first.
GAP_S = 0.02
# The fillers' lengths: the first frees its slot after FILLER_TOKENS tokens, each next one
# FILLER_STEP tokens later. The first must outlast the probe's own reads and sends (a few
# polls, two requests through the engine's HTTP server) on a fast engine and on a busy
# machine: 32 tokens, about a second on two CPU cores, once ended before X and Y were seen
# queued. The step keeps two slots from freeing in the same engine step, so X and Y never
# start together. Fillers are cancelled as soon as X or Y answers: the longer ones never
# run to their end, and the engine is idle while the probe holds it.
FILLER_TOKENS = 64
FILLER_STEP = 4
# How long X or Y may take to answer once both are queued: about the first filler's length.
# The engine's load is not followed meanwhile (the probe runs in the task that follows it).
ANSWER_TIMEOUT_S = 30.0


class VllmPriorityProbe:
    """Tells whether the vLLM engine at ``root`` serves requests in ``priority`` order.

    ``slots`` is the engine's ``--max-num-seqs``: the fillers must hold every one of them so
    that X and Y queue. ``priority`` is the one Backfill sends (the fillers carry it; X one
    worse, Y one better)."""

    def __init__(
        self,
        root: str,
        model: str,
        slots: int,
        priority: int,
        *,
        metrics_url: str | None = None,
        headers: Mapping[str, str] | None = None,
        filler_tokens: int = FILLER_TOKENS,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        answer_timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> None:
        root = root.rstrip("/").removesuffix("/v1")
        self._chat_url = root + "/v1/chat/completions"
        self._metrics_url = metrics_url or root + "/metrics"
        self._model = model
        self._slots = slots
        self._priority = priority
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._filler_tokens = filler_tokens
        self._settle_timeout_s = settle_timeout_s
        self._answer_timeout_s = answer_timeout_s
        self.unknown_reason: str | None = None
        """Why the last ``check`` could not tell (None after one that could)."""
        self.timings: dict[str, float] = {}
        """Seconds from the start of the last ``check`` to each of its steps (for tests and
        the debug log)."""

    async def check(self) -> PriorityOutcome | None:
        """APPLIED or IGNORED; None when the engine could not be measured (busy, slots not
        all held, an error), ``unknown_reason`` saying why. Every request it sent is ended
        when it returns."""
        self.timings = {}
        started = time.monotonic()
        # Slots + X + Y at once: no connection limit. Each ask bounds its own time.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers=self._headers) as session:
            outcome, reason = await self._measure(session, started)
        self.unknown_reason = reason
        log.debug(
            "priority probe of %s: %s (%s)",
            self._chat_url,
            outcome or "unknown",
            reason or ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items()),
        )
        return outcome

    async def _measure(
        self, session: aiohttp.ClientSession, started: float
    ) -> tuple[PriorityOutcome | None, str | None]:
        load = await self._load(session)
        if load is None:
            return None, "its /metrics has no vLLM load gauges"
        if load.running + load.waiting > 0:
            # Others' requests would take the slots that free up, or hold them in between.
            return None, "the engine is busy"
        asks = [
            self._ask(session, self._priority, self._filler_tokens + FILLER_STEP * i)
            for i in range(self._slots)
        ]
        fillers = [asyncio.create_task(a) for a in asks]
        pending = list(fillers)
        try:
            if not await self._until(session, fillers, lambda p: p.running >= self._slots):
                return None, f"the fillers did not hold all {self._slots} slots"
            self.timings["slots held"] = time.monotonic() - started
            # The order X and Y end in, as their answers were read: both may have ended by
            # the time this task looks (a busy machine), the order still tells.
            answered: list[asyncio.Task[int]] = []
            x = asyncio.create_task(self._ask(session, self._priority + 1, 1))
            x.add_done_callback(answered.append)
            pending.append(x)
            await asyncio.sleep(GAP_S)
            y = asyncio.create_task(self._ask(session, self._priority - 1, 1))
            y.add_done_callback(answered.append)
            pending.append(y)
            # Both must wait at once, behind full slots; had a slot freed before Y arrived, X
            # would have taken it whatever the policy.
            if not await self._until(session, [*fillers, x, y], lambda p: p.waiting >= 2):
                return None, "X and Y were not both queued behind full slots"
            self.timings["both queued"] = time.monotonic() - started
            done, _ = await asyncio.wait(
                (x, y), timeout=self._answer_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            self.timings["first answer"] = time.monotonic() - started
            if not done:
                return None, "neither X nor Y was answered in time"
            await asyncio.sleep(0)  # the done callbacks have run
            first = answered[0] if answered else x if x in done else y
            status = first.result()
            if status != 200:
                return None, f"the engine answered HTTP {status}" if status else "no answer"
            return (PriorityOutcome.IGNORED if first is x else PriorityOutcome.APPLIED), None
        finally:
            # Closing a request's connection aborts it in vLLM: the fillers free the engine.
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _until(
        self,
        session: aiohttp.ClientSession,
        running: Sequence[asyncio.Task[int]],
        reached: Callable[[Pressure], bool],
    ) -> bool:
        """Poll /metrics until ``reached``; False on the timeout, or as soon as one of
        ``running`` ended (an error, or a filler that ran out: the slots are no longer full)."""
        deadline = time.monotonic() + self._settle_timeout_s
        while time.monotonic() < deadline:
            if any(task.done() for task in running):
                return False
            load = await self._load(session)
            if load is not None and reached(load):
                return not any(task.done() for task in running)
            await asyncio.sleep(POLL_S)
        return False

    async def _load(self, session: aiohttp.ClientSession) -> Pressure | None:
        try:
            async with session.get(self._metrics_url, timeout=_SHORT) as response:
                if response.status != 200:
                    return None
                found = parse(await response.read(), Flavor.VLLM)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        return found[1] if found is not None else None

    async def _ask(self, session: aiohttp.ClientSession, priority: int, tokens: int) -> int:
        """One chat request; its HTTP status (0: no answer)."""
        body = {
            "model": self._model,
            "messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": tokens,
            # vLLM's extension: exactly ``max_tokens``, so the fillers free their slots one
            # after another at known steps, never at an early end of sequence.
            "ignore_eos": True,
            "temperature": 0,
            "priority": priority,
        }
        timeout = aiohttp.ClientTimeout(total=self._answer_timeout_s + self._settle_timeout_s * 2)
        try:
            async with session.post(
                self._chat_url, data=msgspec.json.encode(body), timeout=timeout
            ) as response:
                await response.read()
                return response.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0


_SHORT = aiohttp.ClientTimeout(total=2.0)
