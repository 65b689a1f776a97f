"""What Backfill tells the outside world when a batch ends (SPEC §10.5, seed 004): the messages
of a terminal state, their bodies, and the retry schedule. Pure: the outbox adapter stores what
this module decides, the notifier sends it."""

from __future__ import annotations

import base64
import re
import secrets
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import getaddresses
from enum import IntEnum, StrEnum
from typing import Any

from backfill.domain import ids
from backfill.domain.lifecycle import BatchStatus
from backfill.errors import InvalidInput


class Channel(StrEnum):
    WEBHOOK = "webhook"
    """The batch's own ``webhook_url``: seed 004's body ``{batch_id, status, metadata}``."""
    ENDPOINT = "endpoint"
    """An org's registered endpoint: OpenAI's event shape ``{id, object, type, data}``."""
    EMAIL = "email"


class DeliveryState(IntEnum):
    PENDING = 0
    DELIVERED = 1
    GIVEN_UP = 2


# OpenAI's event names; an org endpoint subscribes to some of them.
EVENT_OF: dict[BatchStatus, str] = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}
EVENTS = frozenset(EVENT_OF.values())


@dataclass(frozen=True, slots=True)
class EndedBatch:
    """What the messages of a batch's end are made of, read in the transaction that ends it."""

    id: str
    org_id: str
    status: BatchStatus
    metadata: dict[str, str] | None
    webhook_url: str | None
    total: int
    completed: int
    failed: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: str
    url: str
    events: frozenset[str]


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    channel: Channel
    target: str
    event: str
    payload: dict[str, Any]
    endpoint_id: str | None = None


def messages_for(
    batch: EndedBatch, endpoints: Sequence[Endpoint], email: str | None, now: int
) -> list[Message]:
    """Every message the end of ``batch`` sends: its webhook, the org endpoints subscribed to
    the event, the org's email address."""
    event = EVENT_OF[batch.status]
    out: list[Message] = []
    if batch.webhook_url:
        body: dict[str, Any] = {
            "batch_id": batch.id,
            "status": batch.status.value,
            "metadata": batch.metadata,
        }
        out.append(Message(ids.message_id(), Channel.WEBHOOK, batch.webhook_url, event, body))
    for endpoint in endpoints:
        if event in endpoint.events:
            body = {
                "id": ids.event_id(),
                "object": "event",
                "type": event,
                "created_at": now,
                "data": {"id": batch.id},
            }
            out.append(
                Message(ids.message_id(), Channel.ENDPOINT, endpoint.url, event, body, endpoint.id)
            )
    if email:
        body = {
            "batch_id": batch.id,
            "status": batch.status.value,
            "total": batch.total,
            "completed": batch.completed,
            "failed": batch.failed,
        }
        out.append(Message(ids.message_id(), Channel.EMAIL, email, event, body))
    return out


@dataclass(frozen=True, slots=True)
class Notification:
    """A stored message and where its delivery stands."""

    id: str
    org_id: str
    batch_id: str
    channel: Channel
    target: str
    event: str
    payload: dict[str, Any]
    created_at: int
    state: DeliveryState
    attempts: int
    next_at: float
    endpoint_id: str | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    last_attempt_at: int | None = None
    delivered_at: int | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """How one attempt ended. ``next_at`` None: no further attempt (delivered or given up)."""

    delivered: bool
    at: int
    status_code: int | None = None
    error: str | None = None
    next_at: float | None = None


@dataclass(frozen=True, slots=True)
class ReplacedSecret:
    """A signing secret a rotation replaced (sealed), and when."""

    sealed: bytes
    replaced_at: int


@dataclass(frozen=True, slots=True)
class SealedSecrets:
    """An org's signing secrets as stored (sealed with the master key): the current one, and
    the ones rotations replaced, newest first (the store keeps the two last)."""

    current: bytes | None
    replaced: tuple[ReplacedSecret, ...] = ()

    def signing_beside(self, now: float) -> tuple[ReplacedSecret, ...]:
        """The replaced secrets that still sign beside the current one at ``now``: each for
        ``PREVIOUS_SECRET_GRACE_S`` after the rotation that replaced it.

        Every one, not only the last: a receiver told on a rotation that its secret works
        for another day still holds it when a second rotation follows within that day (the
        2026-12-05 review, Info "second rotation").
        """
        return tuple(r for r in self.replaced if now < r.replaced_at + PREVIOUS_SECRET_GRACE_S)


@dataclass(frozen=True, slots=True)
class RetrySchedule:
    """Up to ``attempts`` attempts; the n-th retry waits ``base_s * 4**(n-1)``, at most
    ``max_s``."""

    attempts: int
    base_s: float
    max_s: float = 3600.0

    def after(self, attempts_made: int, now: float) -> float | None:
        """When the next attempt may start, after ``attempts_made`` failed ones; None: give up."""
        if attempts_made >= self.attempts:
            return None
        return now + min(self.max_s, self.base_s * 4.0 ** (attempts_made - 1))


# Rows an org's `webhook_endpoints` may hold, and a replaced secret's grace after its rotation.
MAX_ENDPOINTS_PER_ORG = 16
PREVIOUS_SECRET_GRACE_S = 24 * 3600
MAX_ERROR_CHARS = 300


def new_webhook_secret() -> str:
    """A Standard Webhooks signing secret: ``whsec_`` and base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_context(org_id: str) -> bytes:
    """What a sealed secret is bound to: it opens only as this org's."""
    return f"webhook-secret/{org_id}".encode()


def email_message(payload: dict[str, Any], public_url: str | None) -> tuple[str, str]:
    """The subject and text of a terminal-state email: ids, status and counts, never content."""
    batch_id, status = payload["batch_id"], payload["status"]
    subject = f"Backfill batch {batch_id} {status}"
    path = f"/v1/batches/{batch_id}"
    if public_url:
        base = public_url.rstrip("/")
        where = [f"The batch: {base}{path}", f"Its delivery log: {base}{path}/notifications"]
    else:
        where = [f"Read it with GET {path} on the Backfill API."]
    lines = [
        f"Batch {batch_id} is {status}.",
        "",
        f"Requests: {payload['total']} in all, {payload['completed']} completed, "
        f"{payload['failed']} failed.",
        "",
        *where,
        "",
        "Download the output and error files with an API key of the organization that "
        "created the batch.",
    ]
    return subject, "\n".join(lines) + "\n"


MAX_EMAIL_CHARS = 320
# Loose on purpose (one @, a dot in the domain): the mail server is the judge of the rest.
_ADDRESS = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
_EXAMPLE = "such as ops@example.com"


def notify_address(value: object) -> str | None:
    """``value`` checked as the one address an org's emails go to (None: no emails).

    The address becomes the message's only recipient, so anything a mail library could read
    as several (``,`` or ``;`` lists, ``<…>`` forms) or that could end the SMTP command early
    (NUL, control characters) is refused (the 2026-12-05 review, finding L3).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad_address(f"'email' must be one address {_EXAMPLE}, or null to send none.")
    if len(value) > MAX_EMAIL_CHARS:
        raise _bad_address(
            f"'email' is {len(value)} characters; an address has at most {MAX_EMAIL_CHARS}."
        )
    for at, char in enumerate(value):
        if unicodedata.category(char) == "Cc":
            raise _bad_address(
                f"'email' has a control character (U+{ord(char):04X}) at position {at}; give "
                f"one address {_EXAMPLE}."
            )
    found = [address for _, address in getaddresses([value]) if address]
    if len(found) > 1 or "," in value or ";" in value:
        raise _bad_address(
            f"'email' must be exactly one address, and {value!r} is a list (',' and ';' "
            f"separate addresses). Give one address {_EXAMPLE}; to reach several people, "
            "give a mailing list's address."
        )
    if any(char.isspace() for char in value):
        raise _bad_address(
            f"'email' must be one address {_EXAMPLE}, with no spaces (it is {value!r})."
        )
    if found != [value] or "<" in value or ">" in value:
        raise _bad_address(
            f"'email' must be one bare address {_EXAMPLE}, without a name, angle brackets "
            f"or comments (it is {value!r})."
        )
    if not _ADDRESS.fullmatch(value):
        raise _bad_address(
            f"'email' must be one address with a user and a domain, {_EXAMPLE} (it is {value!r})."
        )
    return value


def _bad_address(message: str) -> InvalidInput:
    return InvalidInput(message, code="invalid_value", param="email")
