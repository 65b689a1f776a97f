"""Runs a ``BatchingModel`` in real time: one timer on the event loop, futures for waiters.

There is one engine step loop however many requests run: a single ``call_at`` timer fires at
the model's next event (a step's end, a request reaching the waiting queue), advances the
model to the current time and wakes the requests that progressed. A late timer loses no
tokens: ``advance`` runs every step that was due, each at its own model time.

Non-streaming requests wake once, when their last token is out; streaming requests also wake
after each batch of steps to write their new tokens. A preempted streaming request leaves
the streams: it is not woken while it waits and is prefilled again, and joins them again
when its prefill ends with its next token (its client sees a pause).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from backfill.simulator.model import BatchingModel, Phase, Progress, Sequence


@dataclass(eq=False)
class Ticket:
    """A submitted request, as its HTTP handler sees it."""

    seq: Sequence
    done: asyncio.Future[None]
    progress: asyncio.Event | None = None
    """Set on each new token of a streaming request; the handler clears it."""


class EngineLoop:
    def __init__(self, model: BatchingModel) -> None:
        self.model = model
        self._tickets: dict[Sequence, Ticket] = {}
        self._streams: set[Ticket] = set()
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, seq: Sequence, *, stream: bool) -> Ticket:
        loop = asyncio.get_running_loop()
        ticket = Ticket(seq, loop.create_future(), asyncio.Event() if stream else None)
        self._tickets[seq] = ticket
        self.model.submit(seq, loop.time())
        self._schedule()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away: free the slot, as vLLM aborts a disconnected request."""
        self._forget(ticket)
        if ticket.seq.phase not in (Phase.DONE, Phase.ABORTED):
            self.model.abort(ticket.seq, asyncio.get_running_loop().time())
            self._schedule()

    def _forget(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket.seq, None)
        self._streams.discard(ticket)

    def _schedule(self) -> None:
        when = self.model.next_event_at()
        if when is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None:
            if self._timer.when() <= when:
                return  # it fires first and reschedules
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(when, self._tick)

    def _tick(self) -> None:
        assert self._timer is not None
        # The loop may run a timer up to its clock resolution early; never advance less than
        # to the event the timer was set for, or it would fire again for nothing.
        now = max(self._timer.when(), asyncio.get_running_loop().time())
        self._timer = None
        self._deliver(self.model.advance(now))
        self._schedule()

    def _deliver(self, progress: Progress) -> None:
        # First tokens before preemptions and finishes: a request that ends at its first
        # token joins the streams and leaves them again in the same call, and so does one
        # that is preempted again in the step after its prefill.
        for seq in (*progress.first_tokens, *progress.resumed):
            ticket = self._tickets.get(seq)
            if ticket is not None and ticket.progress is not None:
                # From now on each decode step brings this stream a token.
                self._streams.add(ticket)
                ticket.progress.set()
        for seq in progress.preempted:
            ticket = self._tickets.get(seq)
            if ticket is not None and seq.phase is Phase.WAITING:  # not resumed since
                self._streams.discard(ticket)
        for seq in progress.finished:
            ticket = self._tickets.pop(seq, None)
            if ticket is None:
                continue
            self._streams.discard(ticket)
            if not ticket.done.done():
                ticket.done.set_result(None)
            if ticket.progress is not None:
                ticket.progress.set()
        if progress.steps:
            for ticket in self._streams:
                assert ticket.progress is not None
                ticket.progress.set()
