"""Engine health as operators and batch owners see it: what each worker's health checks found,
what of it is worth a log line, and, per model, whether an engine can take batch work now
(``domain/waiting.py`` turns that into a batch's ``waiting_on``).

Pure: the runner feeds check results and times in; the store keeps ``EngineReport`` rows so
that every process (an API without a worker included) reads the same picture.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

# An engine that has not answered yet (the worker just started, or started it on demand) is
# reported as down only after this long: a managed llama.cpp loads in a few seconds, and a
# warning at every start would teach operators to ignore the real one.
START_GRACE_S = 10.0

# How long a start on demand is assumed to take before one was measured: a managed llama.cpp
# answers within seconds, a vLLM loading a small model within about a minute; a guess on the
# long side only makes deadlines a little more careful until the first start is timed.
DEFAULT_START_S = 60.0

# Longer reasons are cut: they come from the engine's answer and end up in logs and the API.
MAX_REASON_CHARS = 300


class EngineState(StrEnum):
    UP = "up"
    """Its last health check passed."""
    DOWN = "down"
    """Its last health check failed; ``last_error`` says why."""
    STANDBY = "standby"
    """Stopped on purpose; started when work waits for its models (not a fault)."""
    STARTING = "starting"
    """Started on demand and not answering yet (not a fault until its start takes too long)."""


class Hold(StrEnum):
    """Why an engine that is up takes no batch work now (its worker saw it; a batch's
    ``waiting_on`` code of the same name)."""

    RATE_LIMITED = "rate_limited"
    """It answered 429 (or 503) and nothing succeeded there since: requests wait to retry."""
    INTERACTIVE_LOAD = "interactive_load"
    """A shared engine whose people leave batch work no room: its limit is 0."""


@dataclass(frozen=True, slots=True)
class EngineHold:
    """What keeps an engine that is up from taking batch work, as its worker saw it."""

    hold: Hold
    since: float
    """When it began (Unix seconds): the first 429 after a success, the limit reaching 0."""
    until: float | None = None
    """RATE_LIMITED: when the next request is retried there (Unix seconds)."""
    status: int | None = None
    """RATE_LIMITED: the HTTP status the engine answered last (429 or 503)."""


# A rate limit is reported until this long after its last retry was due with no 429 since:
# requests that gave up (their attempts spent) leave no retry behind to end it.
HOLD_GRACE_S = 5.0


class HoldTracker:
    """What keeps one engine from taking batch work while it is up, as its requests and its
    governor find it: a 429 (or 503) with no success since, or a shared engine's limit at 0
    (people leave batch work no room). Each event says whether the hold began or ended, so
    the worker stores its report then; times are Unix seconds."""

    def __init__(self) -> None:
        self._limited: EngineHold | None = None
        self._people_since: float | None = None

    def overloaded(self, status: int, now: float, retry_at: float) -> bool:
        """A request was answered ``status`` and is retried at ``retry_at``; True when that
        began a rate limit (the first since a success)."""
        began = self._limited is None
        since = now if self._limited is None else self._limited.since
        self._limited = EngineHold(Hold.RATE_LIMITED, since, retry_at, status)
        return began

    def succeeded(self) -> bool:
        """A request succeeded; True when that ended a rate limit."""
        ended = self._limited is not None
        self._limited = None
        return ended

    def people(self, none_left: bool, now: float) -> bool:
        """The governor's limit moved; ``none_left``: a shared engine's people leave batch
        work nothing. True when people's hold began or ended."""
        if none_left == (self._people_since is not None):
            return False
        self._people_since = now if none_left else None
        return True

    def reset(self) -> None:
        """The engine went down or on standby: a rate limit of before says nothing of it once
        it is back."""
        self._limited = None

    def current(self, now: float) -> EngineHold | None:
        """The hold now (a rate limit before people's load: it has a retry time)."""
        limited = self._limited
        if limited is not None and (limited.until is None or now <= limited.until + HOLD_GRACE_S):
            return limited
        if self._people_since is not None:
            return EngineHold(Hold.INTERACTIVE_LOAD, self._people_since)
        return None


class PriorityOutcome(StrEnum):
    """What a probe found of an engine's handling of the ``priority`` Backfill sends (vLLM's
    request priority; adapters/engines/priority_probe.py)."""

    APPLIED = "applied"
    """A queued request of better priority was served before one that arrived earlier."""
    IGNORED = "ignored"
    """Queued requests were served in arrival order (vLLM's default fcfs policy)."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One worker's view of one of its engines, as stored for every process to read."""

    worker: str
    engine: str
    url: str | None
    """Where the worker reaches it, without credentials; None when it has no URL."""
    models: tuple[str, ...]
    state: EngineState
    last_error: str | None
    """Why the last health check failed (None while up or on standby)."""
    since: float
    """When ``state`` began, as this worker saw it (Unix seconds)."""
    checked_at: float | None
    """The last health check (None: not checked yet)."""
    in_flight: int
    max_concurrency: int
    concurrency_limit: int
    mode: str
    signal: str
    pressure: float
    until: float = 0.0
    """The row counts until then; past it, its worker stopped reporting (it died)."""
    priority: str | None = None
    """Whether the engine applies the ``priority`` Backfill sends (a ``PriorityOutcome``
    value), as its probe found; None: not probed (no priority set), or not known yet."""
    start_s: float | None = None
    """How long the engine's starts on demand took to answer, learnt by its worker (None:
    not started on demand by it yet)."""
    hold: EngineHold | None = None
    """Up, but taking no batch work now, and why (None: it takes what its limit allows)."""

    @property
    def healthy(self) -> bool:
        return self.state == EngineState.UP


class NoteKind(StrEnum):
    UP = "up"
    """Answering for the first time since the start (or a standby)."""
    DOWN = "down"
    """Stopped answering: a warning."""
    STILL_DOWN = "still_down"
    """Still not answering, a reminder interval after the last warning."""
    RECOVERED = "recovered"
    """Answering again after a warning."""


@dataclass(frozen=True, slots=True)
class Note:
    """What one health check is worth telling the operator."""

    kind: NoteKind
    down_for_s: float = 0.0
    """How long the engine has been down (DOWN, STILL_DOWN, RECOVERED)."""
    unlogged_outages: int = 0
    """DOWN: outages since the previous warning that went unlogged (the engine flaps)."""


@dataclass(frozen=True, slots=True)
class LogLine:
    """A note in words an operator can act on: which engine, where, what is wrong, what waits."""

    warning: bool
    text: str


def log_line(
    note: Note, *, engine: str, url: str | None, models: Sequence[str], reason: str | None
) -> LogLine:
    where = url or "no URL"
    serves = ", ".join(models) or "no model"
    if note.kind == NoteKind.UP:
        return LogLine(False, f"engine {engine} ({where}) is up")
    if note.kind == NoteKind.RECOVERED:
        return LogLine(
            False, f"engine {engine} ({where}) is up again after {note.down_for_s:.0f} s down"
        )
    if note.kind == NoteKind.DOWN:
        return LogLine(
            True,
            f"engine {engine} ({where}) is down: {reason}; requests for {serves} wait in the "
            f"queue until it answers{_flapping(note.unlogged_outages)}",
        )
    return LogLine(
        True,
        f"engine {engine} ({where}) is still down after {note.down_for_s:.0f} s: {reason}; "
        f"requests for {serves} wait in the queue",
    )


def _flapping(unlogged: int) -> str:
    if not unlogged:
        return ""
    times = "time" if unlogged == 1 else "times"
    return f" (it also went down and came back {unlogged} {times} since the previous warning)"


@dataclass(frozen=True, slots=True)
class Observation:
    changed: bool
    """The state or its reason moved: the stored report should say so now."""
    note: Note | None


class HealthTracker:
    """One engine's health as its checks find it, and which checks are worth a log line.

    A check that finds an engine down after it was up is a warning at once; an engine that has
    not answered yet (just started) gets ``grace_s`` first. While it stays down the warning is
    repeated every ``remind_s``; the check that finds it back after a warning is worth an info
    line saying for how long it was down. Standby (stopped on purpose) is never a warning.

    A flapping engine (down, up, down again) is not a warning at every outage: an outage with
    the same reason as a warning less than ``remind_s`` ago goes unlogged, and so does the
    recovery from it. Unlogged outages are counted, and told with the next warning: the first
    outage of the same reason ``remind_s`` after the last warning, or one that lasts until
    then. An outage with another reason is a warning at once.
    """

    def __init__(
        self, started_at: float, *, remind_s: float, grace_s: float = START_GRACE_S
    ) -> None:
        self.remind_s = remind_s
        self.grace_s = grace_s
        self.state: EngineState | None = None
        self.reason: str | None = None
        self.since = started_at
        self.checked_at: float | None = None
        # When the current outage was last warned about (None: it was not, or it is over).
        self._warned_at: float | None = None
        # When each reason was last warned about, over the last ``remind_s``.
        self._warned: dict[str, float] = {}
        # The current outage was held back (a warning with its reason went out recently).
        self._held = False
        # Outages held back and over since the last warning.
        self._unlogged = 0
        # Answered since the start or the last standby: an outage is then a warning at once.
        self._answered = False

    def observe(self, state: EngineState, reason: str | None, now: float) -> Observation:
        previous, since = self.state, self.since
        reason = _short(reason) if state == EngineState.DOWN else None
        changed = state != previous or reason != self.reason
        self.state, self.reason, self.checked_at = state, reason, now
        if state != previous:
            self.since = now
        if state == EngineState.DOWN:
            return Observation(changed, self._down(reason or _short(None), now))
        return Observation(changed, self._not_down(state, since, now))

    def _not_down(self, state: EngineState, since: float, now: float) -> Note | None:
        """``since``: when the state before this check began."""
        if state == EngineState.STARTING:
            # Not answering yet, on purpose: neither an outage nor a first answer.
            return None
        if state == EngineState.STANDBY:
            # Stopped on purpose: its next start is a fresh one (grace, no flap count).
            self._warned_at, self._held, self._answered, self._unlogged = None, False, False, 0
            self._warned.clear()
            return None
        answered, self._answered = self._answered, True
        if self._held:
            self._held = False
            self._unlogged += 1
        if self._warned_at is not None:
            # A warning goes out only while down, and is forgotten on standby: the state
            # before this check was the outage.
            self._warned_at = None
            return Note(NoteKind.RECOVERED, now - since)
        return None if answered else Note(NoteKind.UP)

    def _down(self, reason: str, now: float) -> Note | None:
        down_for = now - self.since
        if self._warned_at is not None:
            if now - self._warned_at < self.remind_s:
                return None
            self._warned_at = now
            return Note(NoteKind.STILL_DOWN, down_for)
        if not self._answered and down_for < self.grace_s:
            return None
        self._warned = {r: at for r, at in self._warned.items() if now - at < self.remind_s}
        if reason in self._warned:
            self._held = True
            return None
        self._warned[reason] = self._warned_at = now
        note = Note(NoteKind.DOWN, down_for, self._unlogged)
        self._held, self._unlogged = False, 0
        return note


def _short(reason: str | None) -> str:
    text = " ".join((reason or "its health check failed").split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


@dataclass(frozen=True, slots=True)
class ModelHealth:
    """What the live reports say about the engines serving one model."""

    available: bool
    """Some engine serving it is up, starting, or on standby (started as soon as work waits)."""
    down_since: float | None
    """When the last engine serving it stopped answering (None while available)."""
    starting_since: float | None = None
    """None while an engine serving it is up; else, when one began starting or went on
    standby: its work waits for a start on demand."""
    start_s: float | None = None
    """The shortest learnt start among those engines (None: not measured yet)."""
    held: HeldEngines | None = None
    """Engines serving it are up, but every one of them holds batch work back now, and why
    (None: one takes batch work, or none is up)."""


@dataclass(frozen=True, slots=True)
class HeldEngines:
    """Why no engine that is up takes a model's batch work now: the hold that lifts first
    (a rate limit, which has a retry time, before people's load, which has none)."""

    hold: Hold
    engines: tuple[str, ...]
    """The engines held so, by name."""
    since: float
    """The earliest of their holds' beginnings."""
    until: float | None = None
    """RATE_LIMITED: the earliest next retry among them."""
    status: int | None = None
    """RATE_LIMITED: the status they answered (the highest, when they differ)."""
    people: float = 0.0
    """INTERACTIVE_LOAD: people's requests running or waiting on them, as last seen."""


_WAITING = (EngineState.STARTING, EngineState.STANDBY)


def model_health(reports: Iterable[EngineReport]) -> dict[str, ModelHealth]:
    """Each model the ``reports`` name, and whether any of their engines can serve it."""
    return {model: _health(of) for model, of in _by_model(reports).items()}


def _by_model(reports: Iterable[EngineReport]) -> dict[str, list[EngineReport]]:
    by_model: dict[str, list[EngineReport]] = {}
    for report in reports:
        for model in report.models:
            by_model.setdefault(model, []).append(report)
    return by_model


def _health(reports: list[EngineReport]) -> ModelHealth:
    up = [r for r in reports if r.state == EngineState.UP]
    if up:
        # One report of an engine free of holds is enough: some worker sends batch work there.
        if any(r.hold is None for r in up):
            return ModelHealth(True, None)
        return ModelHealth(True, None, held=_held(up))
    waiting = [r for r in reports if r.state in _WAITING]
    if waiting:
        starts = [r.start_s for r in waiting if r.start_s is not None]
        return ModelHealth(
            True, None, min(r.since for r in waiting), min(starts) if starts else None
        )
    return ModelHealth(False, max(r.since for r in reports))


def _held(up: list[EngineReport]) -> HeldEngines:
    """``up``: reports of engines that are up, each with a hold."""
    holds = [(r, r.hold) for r in up if r.hold is not None]
    limited = [(r, h) for r, h in holds if h.hold == Hold.RATE_LIMITED]
    chosen = limited or holds
    untils = [h.until for _, h in chosen if h.until is not None]
    statuses = [h.status for _, h in chosen if h.status is not None]
    # Several workers may report one engine: its people are counted once (the most seen).
    people: dict[str, float] = {}
    for report, _ in chosen:
        people[report.engine] = max(people.get(report.engine, 0.0), report.pressure)
    return HeldEngines(
        hold=Hold.RATE_LIMITED if limited else Hold.INTERACTIVE_LOAD,
        engines=tuple(sorted(people)),
        since=min(h.since for _, h in chosen),
        until=min(untils) if untils else None,
        status=max(statuses) if statuses else None,
        people=sum(people.values()),
    )


def start_delays(reports: Iterable[EngineReport], now: float) -> dict[str, float]:
    """For each model whose live engines are all starting or on standby, about how long until
    one answers: an engine on standby takes its learnt start (``DEFAULT_START_S`` before one
    was measured), a starting one what is left of it. Models with an engine up, or none
    starting, are left out: their work does not wait for a start."""
    delays: dict[str, float] = {}
    for model, of in _by_model(r for r in reports if r.until >= now).items():
        if any(r.state == EngineState.UP for r in of):
            continue
        left = [_start_left(r, now) for r in of if r.state in _WAITING]
        if left:
            delays[model] = min(left)
    return delays


def _start_left(report: EngineReport, now: float) -> float:
    learnt = report.start_s or DEFAULT_START_S
    if report.state == EngineState.STARTING:
        return max(0.0, learnt - (now - report.since))
    return learnt


def replicas_up(reports: Iterable[EngineReport], now: float) -> dict[str, int]:
    """How many replicas of each model are up at ``now``: engines, told apart by name and URL,
    whose last health check by a live worker passed (``until`` not past). An engine several
    workers report counts once; models with none up are left out."""
    up: dict[str, set[tuple[str, str | None]]] = {}
    for report in reports:
        if report.state == EngineState.UP and report.until >= now:
            for model in report.models:
                up.setdefault(model, set()).add((report.engine, report.url))
    return {model: len(replicas) for model, replicas in up.items()}
