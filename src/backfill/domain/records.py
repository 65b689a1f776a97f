"""The records Backfill keeps: tenants, files, batches, the work queue and the ledger.

Ports take and return these; adapters map them to rows. They hold no behaviour beyond
derived properties, so every layer may use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import Prices
from backfill.domain.priority import DEFAULT_MAX_PRIORITY
from backfill.domain.waiting import WaitingOn

T = TypeVar("T")


class ReceiptKind(StrEnum):
    """What a receipt charges for."""

    TOKENS = "tokens"
    """One request of a catalog batch, at its revision's token prices."""
    GPU_TIME = "gpu_time"
    """A span of a private deployment's GPU time."""


@dataclass(slots=True)
class Org:
    id: str
    name: str
    created_at: int
    weight: int = 1
    """Its share of dispatch on engines it shares with other orgs, relative to theirs."""
    max_priority: int = DEFAULT_MAX_PRIORITY
    """The highest priority its batches may be given (domain/priority.py)."""


@dataclass(slots=True)
class ApiKey:
    id: str
    org_id: str
    prefix: str
    scopes: frozenset[str]
    name: str | None = None
    created_at: int = 0
    last_used_at: int | None = None
    revoked_at: int | None = None


@dataclass(slots=True)
class BatchRecord:
    id: str
    org_id: str
    endpoint: str
    model: str
    model_config_id: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    total: int
    metadata: dict[str, str] | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    errors: list[dict[str, Any]] | None = None
    billing: Billing = Billing.CATALOG
    price_input: int | None = None
    price_cached_input: int | None = None
    price_output: int | None = None
    cached_tokens: int = 0
    reserved: int = 0
    charged: int = 0
    output_token_bound: int = 0
    output_expires_after_s: int | None = None
    estimated_completion_at: int | None = None
    """When the planner last projected it to finish (Unix seconds); None: not known."""
    webhook_url: str | None = None
    retry_of: str | None = None
    """The batch whose failed, expired and cancelled lines this one reruns."""
    priority: int = 0
    """Higher first among its org's batches of its model (domain/priority.py)."""
    paused_at: int | None = None
    """When it was paused (claims take none of its lines); None: it is not."""
    urgent: bool = False
    """The planner found it about to miss its window: it goes before higher priorities."""
    output_validation: bool = False
    """Each answer is checked against its line's ``response_format`` schema."""
    waiting_on: WaitingOn | None = field(default=None, metadata={"stored": False})
    """Why it makes no progress now (domain/waiting.py). Not stored as such: the batch
    service derives it from what the workers stored (engine reports, lane waits) when it reads
    the batch."""

    @property
    def prices(self) -> Prices | None:
        return Prices.stored(self.price_input, self.price_cached_input, self.price_output)


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    batch_id: str
    idx: int
    offset: int
    length: int
    custom_id: str
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class WorkBatch:
    """What running a batch's lines needs to know about it: a claim returns it with them, so
    workers never list batches to find work."""

    id: str
    org_id: str
    model: str
    endpoint: str
    input_file_id: str
    billing: Billing
    expires_at: int
    output_validation: bool = False
    """Each answer is checked against its line's ``response_format`` schema."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Lines of one chunk of one batch, leased to the claimer, in index order."""

    batch: WorkBatch
    chunk: int
    items: list[ClaimedItem]


@dataclass(frozen=True, slots=True)
class ItemResult:
    """A request's outcome; a successful (or ``billed``) one of a catalog batch is charged when
    stored."""

    batch_id: str
    idx: int
    lease_token: str
    ok: bool
    payload: bytes
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    request_id: str | None = None
    custom_id: str = ""
    finished_at: float = 0.0
    """When the request ended, by the worker's clock: its receipt's time."""
    billed: bool = False
    """A failed request charged all the same: the engine produced its answer, which did not
    match its line's schema (``output_schema_mismatch``)."""


class Stored(list[bool]):
    """What a result write did: for each result, whether it was stored (its lease still held),
    and ``finished``, the batches whose last result it stored (now ``finalizing``)."""

    def __init__(self, flags: list[bool], finished: frozenset[str] = frozenset()) -> None:
        super().__init__(flags)
        self.finished = finished


@dataclass(frozen=True, slots=True)
class Admission:
    """What accepting one batch must satisfy, checked atomically with its creation."""

    reserve: int
    require_positive_balance: bool
    max_unfinished: int
    max_retained_input_bytes: int
    throughput_tokens_per_s: int | None
    # The input file is kept at least until then, set with the batch row so that an accepted
    # batch never leaves its input on the ordinary upload expiry.
    input_expires_at: int | None = None
    # Refuse a batch that the model's measured throughput cannot finish inside its window
    # behind the lines already accepted.
    deadline_aware: bool = False
    # The key that creates the batch: its spend caps apply, and the batch counts against them.
    api_key_id: str | None = None


# Not frozen: one is built per request served, and a frozen dataclass's __init__ costs twice
# as much (it sets each of these fields through object.__setattr__).
@dataclass(slots=True)
class Receipt:
    request_id: str
    org_id: str
    kind: ReceiptKind
    batch_id: str | None
    custom_id: str | None
    model_config_id: str | None
    deployment_id: str | None
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    prices: Prices | None
    gpu_count: int | None
    gpu_ms: int | None
    amount: int
    started_at: float | None
    created_at: float
    idx: int | None = None
    """The line of ``batch_id`` a token receipt charges; one receipt per line at most."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """An org's money, in picodollars, as the database holds it."""

    credits: int
    charges: int
    balance: int
    reserved: int
    receipts: int = 0

    @property
    def available(self) -> int:
        return self.balance - self.reserved


@dataclass(slots=True)
class StoredResult:
    """One line's stored result. Not frozen: a finalize makes one per line, and a frozen
    dataclass's ``__init__`` costs three times a plain one's."""

    idx: int
    custom_id: str
    ok: bool
    payload: bytes | None
    error_code: str | None
    # Where the line's request is in the batch's input (a failed line's is kept for a rerun);
    # 0 and 0 where the store does not say. Not part of what the result is.
    offset: int = field(default=0, compare=False)
    length: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class FinalizeLease:
    """The answer to ``Store.take_finalize``."""

    taken: bool
    previous: str | None = None
    """The token of the holder before this one (its blobs may be left), when taken."""


@dataclass(frozen=True, slots=True)
class DispatchShare:
    """An org's part of the lines its model's engines took during the planner's last interval."""

    model: str
    org: str
    """The org's name: operators read it on dashboards."""
    share: float


@dataclass(slots=True)
class Page(Generic[T]):
    """One page of a listing, in the API's order; ``has_more`` when another follows."""

    items: list[T] = field(default_factory=list)
    has_more: bool = False


@dataclass(frozen=True, slots=True)
class KeyringRecord:
    """What the database knows about the master key its content was sealed with."""

    check_value: str
    min_blob_format: int
    """The oldest blob format still accepted on read (1 until old blobs are re-encrypted)."""
    created_at: int
