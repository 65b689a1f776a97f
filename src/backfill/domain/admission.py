"""Whether a new batch may be accepted: credit, spend caps, the org's limits and the model's
capacity (configured in output tokens per second, or measured in requests per second).

Pure: the store reads an ``AdmissionSnapshot`` under the org's lock and calls ``check`` inside
the same transaction, so two creations of one org never both pass on the same credit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backfill.domain.durations import format_seconds, parse_duration
from backfill.domain.money import MAX_BALANCE, MAX_BALANCE_USD, pico_to_usd
from backfill.domain.records import Admission, BatchRecord
from backfill.domain.spend_caps import CapUse, check_caps
from backfill.errors import PaymentRequired, RateLimited, retained_input_limit


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """What the store holds for one creation, read under the org's lock."""

    balance: int
    """The org's balance, picodollars."""
    reserved: int
    """What the org's unfinished batches still hold of it, picodollars."""
    unfinished: int
    """The org's batches not yet in a terminal status."""
    retained_input_bytes: int
    """Bytes of the org's input files that are not deleted."""
    queued_output_tokens: int = 0
    """Output tokens still ahead on the batch's model (read only when it has a throughput)."""
    measured_rps: float | None = None
    """The model's measured throughput, requests per second (None: not measured yet)."""
    unfinished_lines: int = 0
    """Lines of the model's accepted batches not yet finished (read only with a rate)."""
    start_delay_s: float = 0.0
    """How long until an engine for the model answers, when all of them run on demand and
    are stopped or starting (read only with a rate; engine_health.start_delays)."""
    caps: tuple[CapUse, ...] = ()
    """The spend caps of the org and of the creating key, with what their windows hold."""

    @property
    def available(self) -> int:
        return self.balance - self.reserved


def output_tokens_left(bound: int, total: int, finished: int) -> int:
    """A batch's output-token bound scaled to the share of its lines not yet finished."""
    return bound * (total - finished) // max(total, 1)


def check_worst_case(reserve: int) -> None:
    """Refuse a reservation no balance could cover; it would not fit the reserved column."""
    if reserve > MAX_BALANCE:
        raise PaymentRequired(
            f"This batch needs {pico_to_usd(reserve)} USD of credit for its worst "
            f"case, more than any balance may hold ({MAX_BALANCE_USD} USD); split the file "
            "or lower max_tokens."
        )


def check_retained(retained: int, adding: int, limit: int) -> None:
    """Refuse when the org's input files would keep more than ``limit`` bytes."""
    if retained + adding > limit:
        raise retained_input_limit(retained, adding, limit)


def check(snapshot: AdmissionSnapshot, batch: BatchRecord, admission: Admission) -> None:
    """Raise the first refusal that applies: credit, spend caps, unfinished batches, retained
    input, then the model's capacity; return when the batch may be accepted."""
    _check_credit(snapshot, admission)
    check_caps(
        snapshot.caps, admission.reserve, admission.require_positive_balance, batch.created_at
    )
    if snapshot.unfinished >= admission.max_unfinished:
        raise RateLimited(
            f"This organization already has {snapshot.unfinished} unfinished batches (the limit "
            f"is {admission.max_unfinished}); wait for one to finish or cancel one, then retry.",
            code="too_many_unfinished_batches",
            # No estimate: room comes back when a batch ends, which may take hours, so the
            # caller is told at once instead of an SDK retrying into the same refusal.
        )
    check_retained(snapshot.retained_input_bytes, 0, admission.max_retained_input_bytes)
    if admission.throughput_tokens_per_s:
        _check_capacity(snapshot.queued_output_tokens, batch, admission.throughput_tokens_per_s)
    if admission.deadline_aware and snapshot.measured_rps:
        check_deadline(
            snapshot.unfinished_lines, batch, snapshot.measured_rps, snapshot.start_delay_s
        )


def _check_credit(snapshot: AdmissionSnapshot, admission: Admission) -> None:
    covered = snapshot.available >= admission.reserve
    if covered and (snapshot.balance > 0 or not admission.require_positive_balance):
        return
    if admission.require_positive_balance:
        raise PaymentRequired(
            f"Batches on a private deployment need a positive balance (it is "
            f"{pico_to_usd(snapshot.balance)} USD); add credit and retry."
        )
    raise PaymentRequired(
        f"This batch needs {pico_to_usd(admission.reserve)} USD of credit for its worst case "
        f"but {pico_to_usd(snapshot.available)} USD is available; add credit or submit fewer "
        "requests. Nothing was queued and the input file can be used again."
    )


def _check_capacity(queued: int, batch: BatchRecord, rate: int) -> None:
    window = batch.expires_at - batch.created_at
    over = queued + batch.output_token_bound - rate * window
    if over <= 0:
        return
    # The queue holds other orgs' work: say only when to retry, rounded up to whole minutes
    # so the wait does not measure their volume to the token.
    wait = _whole_minutes(-(-over // rate))
    raise RateLimited(
        f"{batch.model} cannot take this batch's {batch.output_token_bound} output tokens "
        f"inside {_window(batch)} now. Retry in about {wait}s, use a "
        "longer window, or split the file.",
        code="capacity_exceeded",
        retry_after_s=int(wait),
    )


def check_deadline(
    unfinished: int, batch: BatchRecord, rps: float, start_delay_s: float = 0.0
) -> None:
    """Refuse a batch whose lines, behind the ``unfinished`` lines already accepted for its
    model, the model's measured ``rps`` cannot finish before the batch's deadline, once its
    engine answers (``start_delay_s`` from now, for an engine started on demand)."""
    window = batch.expires_at - batch.created_at
    capacity = rps * max(0.0, window - start_delay_s)
    over = unfinished + batch.total - capacity
    if over <= 0:
        return
    # The backlog is other orgs' work too: the answer is rounded (what fits to two significant
    # digits, the wait to whole minutes), so it does not measure their volume to the line.
    fits = _about(max(0.0, capacity - unfinished))
    wait = _whole_minutes(math.ceil(over / rps))
    room = f"about {fits:,} requests" if fits else "none of its requests"
    if start_delay_s:
        room += f" (its engine starts on demand first, in about {start_delay_s:.0f} s)"
    raise RateLimited(
        f"{batch.model} cannot finish this batch's {batch.total} requests inside "
        f"{_window(batch)} at the rate it serves now: {room} would fit in that "
        f"window now. Retry in about {wait}s, use a longer window, or split the file.",
        code="capacity_exceeded",
        retry_after_s=wait,
    )


def _window(batch: BatchRecord) -> str:
    """The span the batch has, in the words it was given: its completion window, or the
    earlier deadline BatchRouter metadata set (docs/batchrouter.md)."""
    span = batch.expires_at - batch.created_at
    try:
        if parse_duration(batch.completion_window) == span:
            return f"its {batch.completion_window} window"
    except ValueError:
        pass
    return f"the {format_seconds(span)} before its deadline"


def _whole_minutes(seconds: int) -> int:
    return -(-seconds // 60) * 60


def _about(count: float) -> int:
    """``count`` rounded down to two significant digits."""
    whole = int(count)
    if whole < 100:
        return whole
    step = int(10 ** (len(str(whole)) - 2))
    return whole // step * step
