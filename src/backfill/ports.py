"""The interfaces services and the runner depend on; adapters implement them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backfill.domain.catalog import CatalogModel
from backfill.domain.chunks import ChunkRef
from backfill.domain.money import Prices


class Clock(Protocol):
    def now(self) -> float:
        """Unix time in seconds."""
        ...


# ---- content ---------------------------------------------------------------------------


class BlobWriter(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def commit(self) -> int:
        """Make the blob visible atomically; returns its plaintext size."""
        ...

    async def abort(self) -> None: ...


class BlobStore(Protocol):
    """Immutable blobs addressed by key; plaintext in and out (encryption is the adapter's)."""

    async def writer(self, key: str) -> BlobWriter: ...

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the blob."""
        ...

    def stream(self, key: str, start: int = 0, end: int | None = None) -> AsyncIterator[bytes]: ...

    async def size(self, key: str) -> int: ...

    async def delete(self, key: str) -> None: ...

    async def close(self) -> None: ...


class Sealer(Protocol):
    """Encrypts small records (per-request results) that are stored outside blobs."""

    def seal(self, data: bytes, context: bytes) -> bytes: ...

    def open(self, data: bytes, context: bytes) -> bytes: ...


# ---- engines ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReply:
    status: int
    body: bytes
    retry_after_s: float | None = None


class EngineUnreachable(Exception):
    """The engine could not be reached or dropped the connection."""


class EngineTimeout(Exception):
    """The engine did not answer within the request timeout."""


class Engine(Protocol):
    name: str
    max_concurrency: int

    @property
    def models(self) -> tuple[str, ...]:
        """The catalog models this engine serves: what its claims ask for."""
        ...

    def serves(self, model: str) -> bool: ...

    async def send(self, path: str, model: str, body: dict[str, Any]) -> EngineReply:
        """POST ``body`` (its model renamed to the engine's served name) to ``path``."""
        ...

    async def healthy(self) -> bool: ...

    async def close(self) -> None: ...


# ---- metadata --------------------------------------------------------------------------


@dataclass(slots=True)
class Org:
    id: str
    name: str
    created_at: int


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
class FileRecord:
    id: str
    org_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None
    status: str
    lines: int = 0
    model: str | None = None
    endpoint: str | None = None
    batch_id: str | None = None
    prompt_token_bound: int = 0
    max_output_tokens: int = 0


@dataclass(slots=True)
class BatchRecord:
    id: str
    org_id: str
    endpoint: str
    model: str
    model_config_id: str
    input_file_id: str
    completion_window: str
    status: str
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
    billing: str = "catalog"
    price_input: int | None = None
    price_cached_input: int | None = None
    price_output: int | None = None
    cached_tokens: int = 0
    reserved: int = 0
    charged: int = 0
    output_token_bound: int = 0
    output_expires_after_s: int | None = None

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
    billing: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class Claim:
    """Lines of one chunk of one batch, leased to the claimer, in index order."""

    batch: WorkBatch
    chunk: int
    items: list[ClaimedItem]


@dataclass(frozen=True, slots=True)
class ItemResult:
    """A request's outcome; a successful one of a catalog batch is charged when stored."""

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


@dataclass(frozen=True, slots=True)
class Receipt:
    request_id: str
    org_id: str
    kind: str
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


@dataclass(frozen=True, slots=True)
class StoredResult:
    idx: int
    custom_id: str
    ok: bool
    payload: bytes | None
    error_code: str | None


@dataclass(frozen=True, slots=True)
class FinalizeLease:
    """The answer to ``Store.take_finalize``."""

    taken: bool
    previous: str | None = None
    """The token of the holder before this one (its blobs may be left), when taken."""


@dataclass(slots=True)
class Page:
    items: list[Any] = field(default_factory=list)
    has_more: bool = False


class Store(Protocol):
    """Durable metadata and the work queue."""

    async def init(self) -> None: ...

    async def close(self) -> None: ...

    # tenants
    async def create_org(self, org: Org) -> None: ...

    async def org_by_name(self, name: str) -> Org | None: ...

    async def count_orgs(self) -> int: ...

    async def create_api_key(self, key: ApiKey, secret_hash: str) -> None: ...

    async def api_key_by_hash(self, secret_hash: str) -> ApiKey | None:
        """The key with this hash, revoked or not (the caller refuses revoked ones)."""
        ...

    async def list_api_keys(self, org_id: str) -> list[ApiKey]:
        """Every key of an org, revoked ones included, oldest first."""
        ...

    async def revoke_api_key(self, key_id: str, now: int) -> ApiKey | None:
        """Mark a key revoked (keeping the first revocation's time); None when there is none."""
        ...

    async def touch_api_key(self, key_id: str, now: int, resolution_s: int) -> None:
        """Set last_used_at to ``now`` unless it is already within ``resolution_s`` of it;
        best effort: a failure here must not refuse the request."""
        ...

    # files
    async def create_file(self, record: FileRecord, max_retained_bytes: int | None = None) -> None:
        """Insert a file; with ``max_retained_bytes``, refuse (RateLimited) in the same
        transaction when the org's input files would then keep more than that."""
        ...

    async def retained_input_bytes(self, org_id: str) -> int:
        """Bytes of the org's input files that are not deleted."""
        ...

    async def get_file(self, org_id: str, file_id: str) -> FileRecord | None: ...

    async def list_files(
        self, org_id: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> Page: ...

    async def mark_file_deleted(self, file_id: str) -> None: ...

    async def expired_files(self, now: int, limit: int) -> list[FileRecord]:
        """Files past ``expires_at`` that no unfinished batch needs."""
        ...

    async def purge_results(self, batch_id: str) -> None:
        """Forget the per-request results a batch's result files were built from."""
        ...

    async def unfinished_batch_for_file(self, file_id: str) -> str | None: ...

    # catalog
    async def list_models(self) -> list[CatalogModel]: ...

    async def upsert_model(self, model: CatalogModel, now: int, *, replace: bool) -> None: ...

    # billing
    async def credit(self, org_id: str, amount: int, note: str | None, now: int) -> Ledger:
        """Append a credit unless it would take the balance past its cap (InvalidInput);
        returns the ledger as that same transaction left it."""
        ...

    async def ledger(self, org_id: str) -> Ledger: ...

    async def balances(self, org_ids: Sequence[str]) -> dict[str, int]: ...

    async def get_receipt(self, org_id: str, request_id: str) -> Receipt | None: ...

    async def charge_gpu_time(self, receipt: Receipt) -> None: ...

    # batches
    async def create_batch(self, batch: BatchRecord, admission: Admission) -> None:
        """Insert the batch, reserving credit and enforcing limits in the same transaction."""
        ...

    async def add_items(self, batch_id: str, chunks: Sequence[ChunkRef]) -> bool:
        """Queue the chunks' lines (idempotently) while the batch may still run
        (``validating``, or ``in_progress`` for a repeated resume); False, adding nothing,
        once it is cancelling, finalizing or over."""
        ...

    async def get_batch(self, org_id: str | None, batch_id: str) -> BatchRecord | None: ...

    async def batch_by_idempotency_key(self, org_id: str, key: str) -> BatchRecord | None: ...

    async def list_batches(self, org_id: str, after: str | None, limit: int) -> Page: ...

    async def transition(
        self, batch_id: str, from_statuses: Sequence[str], to: str, now: int
    ) -> bool:
        """Move a batch to ``to`` if it is in one of ``from_statuses``; sets the timestamp."""
        ...

    async def batches_in(self, statuses: Sequence[str]) -> list[BatchRecord]: ...

    async def lifecycle_batches(self, now: float) -> list[BatchRecord]:
        """Validating, cancelling and finalizing batches, and in-progress ones past their
        deadline: what a lifecycle pass acts on, without reading every running batch."""
        ...

    async def finish_drained(self, now: int) -> int:
        """Move in-progress batches whose lines are all done to ``finalizing``."""
        ...

    # work queue
    async def claim(
        self, models: Sequence[str], limit: int, token: str, lease_until: float, now: float
    ) -> list[Claim]:
        """Lease up to ``limit`` queued lines of running batches of ``models``, a chunk at a
        time, from the least-served (model, org) lanes first."""
        ...

    async def requeue_expired(self, now: float) -> int:
        """Put leased lines whose lease ran out back in the queue; how many."""
        ...

    async def renew_leases(
        self, token: str, lease_until: float, held: Mapping[str, Collection[int]]
    ) -> None:
        """Extend the leases of ``held`` (batch id → item indexes) that ``token`` still holds;
        leases nobody works on any more are left to run out."""
        ...

    async def release_all_leases(self) -> None: ...

    async def release(
        self, batch_id: str, idx: int, token: str, not_before: float | None = None
    ) -> None:
        """Put a leased item back in the queue without counting an attempt; with
        ``not_before`` no worker claims it before that time (a backoff)."""
        ...

    async def write_results(self, results: Sequence[ItemResult]) -> list[bool]:
        """Store results whose lease is still held; says for each whether it was accepted."""
        ...

    async def live_leases(self, batch_id: str, now: float) -> int: ...

    async def gauges(self) -> tuple[dict[str, int], int]:
        """(batches by status, requests of unfinished batches not yet done), for metrics."""
        ...

    async def ping(self) -> None:
        """Raise when the database cannot be reached."""
        ...

    async def close_unfinished(self, batch_id: str, error_code: str) -> int:
        """Mark every unfinished item of a batch failed with ``error_code``; fences late writers."""
        ...

    def iter_results(self, batch_id: str) -> AsyncIterator[list[StoredResult]]: ...

    async def take_finalize(
        self, batch_id: str, statuses: Sequence[str], token: str, until: float, now: float
    ) -> FinalizeLease:
        """Take the batch's finalize lease until ``until`` if the batch is in ``statuses`` and
        the lease is free, expired or ``token``'s already; one statement decides."""
        ...

    async def renew_finalize(self, batch_id: str, token: str, until: float) -> bool:
        """Extend the lease while ``token`` still holds it; False once it was taken over."""
        ...

    async def release_finalize(self, batch_id: str, token: str) -> None:
        """Let the lease go now (the token stays, for the next holder's cleanup)."""
        ...

    async def publish(
        self,
        batch_id: str,
        expected_status: str,
        status: str,
        now: int,
        output: FileRecord,
        errors: FileRecord,
        *,
        token: str,
    ) -> bool:
        """Create the result files and set the terminal status in one transaction, only while
        the batch is ``expected_status`` and ``token`` holds its finalize lease."""
        ...

    async def take_singleton(self, name: str, holder: str, until: float, now: float) -> bool:
        """Hold the named lease until ``until`` if it is free, expired or ``holder``'s."""
        ...

    async def fail_batch(
        self, batch_id: str, expected_status: str, now: int, errors: list[dict[str, Any]]
    ) -> bool:
        """Move a batch that could not start to ``failed`` with ``errors`` (OpenAI's
        ``errors.data``) and give back its reservation; False when its status moved on."""
        ...


@dataclass(frozen=True, slots=True)
class KeyringRecord:
    """What the database knows about the master key its content was sealed with."""

    check_value: str
    min_blob_format: int
    """The oldest blob format still accepted on read (1 until old blobs are re-encrypted)."""
    created_at: int


class KeyringStore(Protocol):
    """The master-key check value and blob-format floor, and the content they guard."""

    async def keyring(self) -> KeyringRecord | None: ...

    async def init_keyring(self, record: KeyringRecord) -> KeyringRecord:
        """Store ``record`` unless one is stored already; returns the stored one."""
        ...

    async def set_min_blob_format(self, version: int) -> None: ...

    async def holds_content(self) -> bool:
        """Whether any file or batch exists (content sealed under some master key)."""
        ...

    async def stored_file_ids(self, after: str | None, limit: int) -> list[str]:
        """Ids of files not deleted, in id order, after ``after``."""
        ...


class Catalog(Protocol):
    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        """The model ``name`` as ``org_id`` sees it (private deployments only to their owner)."""
        ...

    async def all(self, org_id: str | None = None) -> list[CatalogModel]: ...
