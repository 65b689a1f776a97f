"""The audit log (docs/observability.md): who changed what, when, from where, and how it ended.

An action in progress is an ``AuditScope``, held in a context variable for the request or the
admin command that makes it. The database's write transaction appends the scope's row in the
same transaction as the change (one insert); the edge settles the outcome once the answer is
known, and writes the row itself for an action that never reached a write (a refusal). A row
never holds content or secrets: names, ids, the address, the status and the error's code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum

# Who acted, when it was no API key.
ADMIN = "admin"
# Where an admin command run on the machine itself came from.
CLI_ADDRESS = "cli"

# The widths of the audit table's columns; longer values are cut, never refused: an audit row
# must not be what makes an action fail.
MAX_TARGET_CHARS = 256
MAX_ADDRESS_CHARS = 64


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One row of the audit log."""

    id: int
    at: float
    actor: str
    org_id: str | None
    action: str
    target: str | None
    address: str | None
    outcome: Outcome
    status: int
    error: str | None


@dataclass(slots=True)
class AuditScope:
    """An action being made: filled in as the request goes (what, who, on what), then recorded.
    ``action`` stays empty for a request that is no audited action."""

    at: float
    address: str | None
    action: str = ""
    actor: str | None = None
    org_id: str | None = None
    target: str | None = None
    # The id of the row appended in the change's own transaction, once it committed.
    recorded: int | None = None
    # A transaction is appending the row now: no other may (overlapping writes of one action).
    claimed: bool = False
    # Inside ``aside()``: writes that prepare the action are not the change itself.
    aside: int = 0
    # Set once the action's answer is known: a write after that (a task the request started)
    # is not the action's.
    closed: bool = False

    def entry(self, outcome: Outcome, status: int, error: str | None = None) -> AuditEntry:
        return AuditEntry(
            id=0,
            at=self.at,
            actor=self.actor or "anonymous",
            org_id=self.org_id,
            action=self.action,
            target=_cut(self.target, MAX_TARGET_CHARS),
            address=_cut(self.address, MAX_ADDRESS_CHARS),
            outcome=outcome,
            status=status,
            error=_cut(error, 64),
        )


_current: ContextVar[AuditScope | None] = ContextVar("backfill_audit_scope", default=None)


@contextmanager
def acting(scope: AuditScope) -> Iterator[AuditScope]:
    """Makes ``scope`` the action of the code run inside (and of the tasks it starts)."""
    token = _current.set(scope)
    try:
        yield scope
    finally:
        scope.closed = True
        _current.reset(token)


def pending() -> AuditScope | None:
    """The action a write transaction should record now: one still open, not yet recorded,
    whose actor is known (a write made while checking the credentials, such as a key's
    last use, is not the action's)."""
    scope = _current.get()
    if scope is None or scope.closed or scope.recorded is not None or scope.claimed:
        return None
    if scope.aside or not scope.action or scope.actor is None:
        return None
    return scope


@contextmanager
def aside() -> Iterator[None]:
    """Writes made inside prepare the action (a rerun's input file before its batch): the
    action's row commits with the change that follows, not with them."""
    scope = _current.get()
    if scope is None:
        yield
        return
    scope.aside += 1
    try:
        yield
    finally:
        scope.aside -= 1


def note_action(action: str, target: str | None = None) -> None:
    """What the request being served does (its route says), and on what."""
    scope = _current.get()
    if scope is not None and not scope.closed:
        scope.action = action
        scope.target = target


def note_actor(actor: str, org_id: str | None = None) -> None:
    """Who is acting (the admin, or an API key's id and its organization)."""
    scope = _current.get()
    if scope is not None and not scope.closed:
        scope.actor = actor
        scope.org_id = org_id


def note_target(target: str) -> None:
    """What the action acts on, where the path does not say it (an id made by the action): the
    path's target, when it has one, stays (a rerun is recorded on the batch it reruns)."""
    scope = _current.get()
    if scope is not None and not scope.closed and scope.target is None:
        scope.target = target


def _cut(value: str | None, limit: int) -> str | None:
    return None if value is None else value[:limit]
