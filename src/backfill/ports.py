"""The interfaces services and the runner depend on; adapters implement them.

The database is split by role (as pgqueuer's repository ports are): each consumer names the
narrowest role it uses, and ``SqlStore`` satisfies all of them structurally.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from backfill.domain.audit import AuditEntry, Outcome
from backfill.domain.catalog import CatalogModel
from backfill.domain.chunks import ChunkRef
from backfill.domain.engine_config import StoredEngine
from backfill.domain.engine_health import EngineReport, PriorityOutcome
from backfill.domain.files import FileRecord
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.notifications import Attempt, Endpoint, Notification, SealedSecrets
from backfill.domain.overview import (
    BatchCharges,
    LedgerEntry,
    ModelQueue,
    OrgAccount,
    OrgCredit,
)
from backfill.domain.progress import BatchProgress
from backfill.domain.records import (
    Admission,
    ApiKey,
    BatchRecord,
    Claim,
    DispatchShare,
    FinalizeLease,
    ItemResult,
    KeyringRecord,
    Ledger,
    Org,
    Page,
    Receipt,
    Stored,
    StoredResult,
)
from backfill.domain.result_cursor import PagedResult, ResultCursor
from backfill.domain.scheduling.concurrency import Pressure
from backfill.domain.scheduling.demand import DemandInputs
from backfill.domain.scheduling.planning import Plan, PlanInputs
from backfill.domain.spend_caps import CapUse, Period, SpendCap
from backfill.domain.waiting import AheadInLane, LaneWait


class Clock(Protocol):
    def now(self) -> float:
        """Unix time in seconds: what is stored and shown."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: what intervals, pauses and backoffs within
        one process are measured with."""
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

    async def exists(self, key: str) -> bool:
        """Whether anything is stored at ``key``; its content is not looked at. For content
        that may rightly be absent, which must not read as damage."""
        ...

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


@runtime_checkable
class EngineDiagnostics(Protocol):
    """What an ``Engine`` may also tell operators: where it is and why its last health check
    failed. Engines without it are reported with no URL and a generic reason."""

    @property
    def url(self) -> str | None:
        """Where the engine is reached, without credentials."""
        ...

    @property
    def health_error(self) -> str | None:
        """Why the last ``healthy()`` answered False (refused, timed out, which status), in
        words for an operator; None after one that answered True. Never request content."""
        ...


class Switch(Protocol):
    """The process of an engine that runs only while work waits for it."""

    @property
    def running(self) -> bool:
        """Started and not stopped since (it may not answer yet)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """End the process; ``running`` is False from the call on."""
        ...


class DiscoveryFailed(Exception):
    """The replicas could not be looked up (the name server failed or did not answer): what
    was found before still stands. A name with no addresses is not a failure."""


class ReplicaFinder(Protocol):
    """Where the replicas of one engine are now (docs/fleet.md)."""

    @property
    def name(self) -> str:
        """What is looked up, for operators."""
        ...

    async def find(self) -> frozenset[tuple[str, int]]:
        """Every replica's (address, port); raises ``DiscoveryFailed``."""
        ...


@dataclass(frozen=True, slots=True)
class FetchedMedia:
    """A remote medium fetched for a request: its bytes and the content type it came with."""

    content_type: str
    data: bytes


class MediaFetchFailed(Exception):
    """A remote medium could not be fetched, or was refused (SSRF rules, size, type, time).

    ``message`` ends up in the request's own error row, so it may name the URL's host and the
    rule, but never content."""

    code = "image_fetch_failed"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MediaFetcher(Protocol):
    """Fetches a user's remote media (https image URLs) when the request runs, so engines
    never fetch user URLs (SPEC §10.4)."""

    async def fetch(self, url: str, content_types: Collection[str]) -> FetchedMedia:
        """The body at ``url`` if its type is one of ``content_types`` (e.g. ``image/png``);
        raises ``MediaFetchFailed`` otherwise."""
        ...

    async def close(self) -> None: ...


class DeliveryFailed(Exception):
    """A notification could not be delivered: ``reason`` for its owner (never content)."""

    def __init__(self, reason: str, status_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class WebhookSender(Protocol):
    """Posts signed webhooks through the SSRF-safe client (SPEC §10.4, §10.5)."""

    def refusal(self, url: str) -> str | None:
        """Why ``url`` may not receive webhooks (None: it may), without connecting."""
        ...

    async def deliver(self, url: str, message_id: str, body: bytes, secrets: Sequence[str]) -> int:
        """POST ``body`` signed with each of ``secrets``; the answer's status code. Raises
        ``DeliveryFailed`` when no answer came (refused, unreachable, timed out)."""
        ...

    async def close(self) -> None: ...


class Mailer(Protocol):
    async def send(self, to: str, subject: str, text: str) -> None:
        """Raises ``DeliveryFailed`` when the mail server did not take the message."""
        ...


class WaitingWork(Protocol):
    """What the queue tells about work no engine has claimed yet (a ``WorkQueue`` role)."""

    async def ready_models(self, models: Sequence[str], now: float) -> set[str]:
        """Which of ``models`` have queued lines a claim could take at ``now``."""
        ...


class PressureProbe(Protocol):
    """Reads a shared engine's own load (its metrics)."""

    absent: bool
    """True once the engine answered that it has no metrics Backfill can read."""

    async def read(self) -> Pressure | None:
        """The engine's load now; None when it cannot be read."""
        ...

    async def close(self) -> None: ...


class PriorityProbe(Protocol):
    """Finds out, by experiment on an idle engine, whether it applies the request priority
    Backfill sends (a vLLM started without ``--scheduling-policy priority`` ignores it)."""

    unknown_reason: str | None
    """Why the last ``check`` could not tell (the engine was busy, ...)."""

    async def check(self) -> PriorityOutcome | None:
        """APPLIED or IGNORED; None when this try could not tell."""
        ...


class TenantStore(Protocol):
    """Organizations and their API keys."""

    async def create_org(self, org: Org) -> None: ...

    async def org_by_name(self, name: str) -> Org | None: ...

    async def count_orgs(self) -> int: ...

    async def set_org_weight(self, org_id: str, weight: int) -> Org | None:
        """Set the org's fair-share weight; the org as stored after, None when there is none."""
        ...

    async def create_api_key(self, key: ApiKey, secret_hash: str) -> None: ...

    async def api_key_by_hash(self, secret_hash: str) -> ApiKey | None:
        """The key with this hash, revoked or not (the caller refuses revoked ones)."""
        ...

    async def list_api_keys(self, org_id: str) -> list[ApiKey]:
        """Every key of an org, revoked ones included, oldest first."""
        ...

    async def api_key_by_id(self, key_id: str) -> ApiKey | None:
        """The key with this id, revoked or not."""
        ...

    async def revoke_api_key(self, key_id: str, now: int) -> ApiKey | None:
        """Mark a key revoked (keeping the first revocation's time); None when there is none."""
        ...

    async def touch_api_key(self, key_id: str, now: int, resolution_s: int) -> None:
        """Set last_used_at to ``now`` unless it is already within ``resolution_s`` of it;
        best effort: a failure here must not refuse the request."""
        ...


class FileStore(Protocol):
    """File records: uploads, result files, and what retention may delete."""

    async def create_file(self, record: FileRecord, max_retained_bytes: int | None = None) -> None:
        """Insert a file; with ``max_retained_bytes``, refuse (RateLimited) in the same
        transaction when the org's input files would then keep more than that."""
        ...

    async def retained_input_bytes(self, org_id: str, now: int | None = None) -> int:
        """Bytes of the org's input files that are not deleted (with ``now``: nor past their
        expiry and read by no unfinished batch, as those read as removed)."""
        ...

    async def get_file(self, org_id: str, file_id: str) -> FileRecord | None: ...

    async def list_files(
        self,
        org_id: str,
        purpose: str | None,
        after: str | None,
        limit: int,
        ascending: bool,
        now: int | None = None,
    ) -> Page[FileRecord]:
        """The org's files that are not deleted; with ``now``, also without those past their
        expiry that no unfinished batch reads (what the janitor removes next)."""
        ...

    async def mark_file_deleted(self, file_id: str) -> None: ...

    async def expired_files(self, now: int, limit: int) -> list[FileRecord]:
        """Files past ``expires_at`` that no unfinished batch needs."""
        ...

    async def purge_results(self, batch_id: str) -> None:
        """Forget the per-request results a batch's result files were built from."""
        ...

    async def unfinished_batch_for_file(self, file_id: str) -> str | None: ...


class CatalogStore(Protocol):
    """The model revisions and private deployments requests can name."""

    async def list_models(self) -> list[CatalogModel]:
        """Every entry, by id, each with its aliases."""
        ...

    async def upsert_model(
        self, model: CatalogModel, now: int, *, replace: bool
    ) -> CatalogModel | None:
        """Insert ``model``; where its id is taken, with ``replace``, write it over the entry
        only when both have the same owner (both public, or the same org). Returns the entry
        that had the id before (None: ``model`` was inserted).

        What is written holds exactly ``model``'s names (its id and its aliases): a name that
        another entry holds, as its id or an alias, raises ``name_taken``'s error and nothing
        is written, however concurrent writers race."""
        ...


class LedgerStore(Protocol):
    """Each org's credit, charges and receipts."""

    async def credit(self, org_id: str, amount: int, note: str | None, now: int) -> Ledger:
        """Append a credit unless it would take the balance past its cap (InvalidInput);
        returns the ledger as that same transaction left it."""
        ...

    async def ledger(self, org_id: str) -> Ledger: ...

    async def balances(self, org_ids: Sequence[str]) -> dict[str, int]: ...

    async def get_receipt(self, org_id: str, request_id: str) -> Receipt | None: ...

    async def charge_gpu_time(self, receipt: Receipt) -> None: ...


class BatchStore(Protocol):
    """Batch records and their status changes."""

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

    async def max_priority(self, org_id: str) -> int:
        """The highest priority org ``org_id``'s batches may be given."""
        ...

    async def list_batches(
        self, org_id: str, after: str | None, limit: int
    ) -> Page[BatchRecord]: ...

    async def transition(
        self, batch_id: str, from_statuses: Sequence[BatchStatus], to: BatchStatus, now: int
    ) -> bool:
        """Move a batch to ``to`` if it is in one of ``from_statuses``; sets the timestamp."""
        ...

    async def batches_in(self, statuses: Sequence[BatchStatus]) -> list[BatchRecord]: ...

    async def lifecycle_batches(self, now: float) -> list[BatchRecord]:
        """Validating, cancelling and finalizing batches, and in-progress ones past their
        deadline: what a lifecycle pass acts on, without reading every running batch."""
        ...

    async def finish_drained(self, now: int) -> int:
        """Move in-progress batches whose lines are all done to ``finalizing``."""
        ...

    async def fail_batch(
        self, batch_id: str, expected_status: BatchStatus, now: int, errors: list[dict[str, Any]]
    ) -> bool:
        """Move a batch that could not start to ``failed`` with ``errors`` (OpenAI's
        ``errors.data``) and give back its reservation; False when its status moved on."""
        ...


class EndedBatchStore(BatchStore, Protocol):
    """Batches that ended: what rerunning and deleting them needs beyond ``BatchStore``."""

    async def delete_batch(self, org_id: str, batch_id: str, now: int) -> list[str] | None:
        """Delete an ended batch of ``org_id`` with its queue items and notifications (its
        receipts stay), in one transaction that also makes its result files expire at
        ``now``, so the janitor removes them should the caller not finish doing so. Returns
        those files' ids; None, changing nothing, when the org has no such ended batch."""
        ...


class WorkQueue(Protocol):
    """The lines of running batches: leased to workers, released, answered, and planned (lane
    urgency, measured throughput, completion estimates)."""

    async def claim(
        self, models: Sequence[str], limit: int, token: str, lease_until: float, now: float
    ) -> list[Claim]:
        """Lease up to ``limit`` queued lines of running batches of ``models``, a chunk at a
        time: urgent (model, org) lanes first, then by weighted fair share."""
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

    async def write_results(self, results: Sequence[ItemResult]) -> Stored:
        """Store results whose lease is still held; says for each whether it was accepted, and
        which batches the write finished."""
        ...

    async def live_leases(self, batch_id: str, now: float) -> int: ...

    async def close_unfinished(self, batch_id: str, error_code: str) -> int:
        """Mark every unfinished item of a batch failed with ``error_code``; fences late writers."""
        ...

    async def plan_inputs(self) -> PlanInputs:
        """Every lane, each model's measured rate and the running batches, for the planner."""
        ...

    async def apply_plan(self, plan: Plan) -> None:
        """Store a plan: lane marks, shares and urgency, model rates, batch estimates."""
        ...


class ResultStore(Protocol):
    """A finished batch's results and the lease that lets one worker publish them."""

    def iter_results(self, batch_id: str) -> AsyncIterator[list[StoredResult]]: ...

    async def take_finalize(
        self, batch_id: str, statuses: Sequence[BatchStatus], token: str, until: float, now: float
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
        expected_status: BatchStatus,
        status: BatchStatus,
        now: int,
        output: FileRecord,
        errors: FileRecord,
        *,
        token: str,
    ) -> bool:
        """Create the result files and set the terminal status in one transaction, only while
        the batch is ``expected_status`` and ``token`` holds its finalize lease."""
        ...


class ResultPages(Protocol):
    """A batch's results as stored so far, for readers while it runs."""

    async def results_after(
        self, batch_id: str, cursor: ResultCursor, limit: int
    ) -> list[PagedResult]:
        """Up to ``limit`` stored results past ``cursor``, in the cursor's part: numbered
        ones by the order they were stored, or unnumbered done lines (closed without a
        result, or stored before numbering) by line. Sealed payloads are returned as stored;
        a payload and error code both None means the results were purged."""
        ...

    async def progress_history(
        self, org_id: str, batch_id: str, max_points: int
    ) -> BatchProgress | None:
        """The batch's results stored over time: the times of at most ``max_points`` of its
        result numbers, evenly spaced, the first and the last among them (one indexed lookup,
        never a walk over its lines); no points when one of those has no time (stored before
        times were kept). None when ``org_id`` has no such batch."""
        ...


class OperationsStore(Protocol):
    """What operators read (reachability, gauges) and the leases that let one process at a
    time run a chore for everyone."""

    async def ping(self) -> None:
        """Raise when the database cannot be reached."""
        ...

    async def gauges(self) -> tuple[dict[str, int], int]:
        """(batches by status, requests of unfinished batches not yet done), for metrics."""
        ...

    async def take_singleton(self, name: str, holder: str, until: float, now: float) -> bool:
        """Hold the named lease until ``until`` if it is free, expired or ``holder``'s."""
        ...

    async def dispatch_shares(self) -> list[DispatchShare]:
        """Each org's part of its model's dispatch over the planner's last interval (lanes
        that took none are left out)."""
        ...


class NotificationStore(Protocol):
    """The notification outbox (written when batches end) and the org settings it reads."""

    async def claim_notifications(
        self, now: float, token: str, until: float, limit: int
    ) -> list[Notification]:
        """Lease up to ``limit`` due pending messages for one attempt each (their ``attempts``
        already counts it); no two callers get the same message before ``until``."""
        ...

    async def finish_attempt(self, message_id: str, token: str, attempt: Attempt) -> bool:
        """Record how the leased attempt ended; False when the lease was lost meanwhile."""
        ...

    async def give_back(self, message_id: str, token: str, now: float) -> bool:
        """Hand back a leased attempt that was never made (its sender is stopping): due at
        ``now`` again, and not counted."""
        ...

    async def prune_notifications(self, settled_before: int) -> int:
        """Remove delivered and given-up messages created before ``settled_before``."""
        ...

    async def batch_notifications(self, org_id: str, batch_id: str) -> list[Notification]: ...

    async def webhook_secrets(self, org_id: str) -> SealedSecrets: ...

    async def set_webhook_secret(
        self, org_id: str, sealed: bytes, now: int, *, rotate: bool
    ) -> SealedSecrets:
        """Store a new secret: with ``rotate`` the current one becomes the last replaced (the
        two last are kept, each with the time it was replaced); without, only when the org
        has none yet (the stored ones are returned either way)."""
        ...

    async def add_webhook_endpoint(
        self, org_id: str, endpoint: Endpoint, now: int, max_endpoints: int
    ) -> bool:
        """False when the org already has ``max_endpoints``."""
        ...

    async def webhook_endpoints(self, org_id: str) -> list[Endpoint]: ...

    async def remove_webhook_endpoint(self, org_id: str, endpoint_id: str) -> bool: ...

    async def set_notify_email(self, org_id: str, email: str | None) -> None: ...

    async def notify_email(self, org_id: str) -> str | None: ...


class OverviewStore(Protocol):
    """Read models for the dashboard: who a key's org is, its credit, ledger entries and
    batches' charges, a batch's failed lines, each org's credit and the queue by model. Reads
    only; each costs about what it returns (no read of an org's receipts or of a batch's
    successful lines)."""

    async def org_by_id(self, org_id: str) -> Org | None: ...

    async def org_account(self, org_id: str) -> OrgAccount | None:
        """The org with its balance, reservation and lifetime credits, read in one snapshot
        from its row and its credits."""
        ...

    async def ledger_entries(self, org_id: str, after: str | None, limit: int) -> Page[LedgerEntry]:
        """The org's credits and the charges of its catalog batches (those charged or holding
        a reservation), newest first (a batch by its listing key ``seq``, a credit by the
        second it was added); ``after`` is an entry id of the org from an earlier page
        (another id is InvalidInput, ``param: after``)."""
        ...

    async def batch_charges(self, org_id: str, batch_ids: Sequence[str]) -> list[BatchCharges]:
        """The charges of the org's batches among ``batch_ids``, in one read, in no set
        order; ids of no batch of the org are left out."""
        ...

    async def failed_results(
        self, org_id: str, batch_id: str, after_idx: int, limit: int
    ) -> list[StoredResult]:
        """Up to ``limit`` stored results of the batch's failed lines with an index above
        ``after_idx``, by index; none when the batch is not the org's."""
        ...

    async def org_credits(self, after: str | None, limit: int) -> Page[OrgCredit]:
        """Every org with its balance and reservation, oldest first; ``after`` is an org id
        from an earlier page (an unknown one is InvalidInput, ``param: after``)."""
        ...

    async def queue_by_model(self) -> list[ModelQueue]:
        """Unfinished batches grouped by model, by model name."""
        ...

    async def demand_inputs(self) -> DemandInputs:
        """What each model's queue asks of its fleet, from stored state only: the validating
        and in-progress batches with lines left, the planner's rate per replica by model, and
        every worker's engine rows (the caller's time decides which still count)."""
        ...


class EngineHealthStore(Protocol):
    """Each worker's report of its engines' health, so that every process (an API without a
    worker too) shows the same picture; and the running batches that may wait on them."""

    async def report_engines(self, reports: Sequence[EngineReport], now: float) -> None:
        """Store ``reports`` (one row per worker and engine, replacing that worker's earlier
        row) and forget rows whose ``until`` passed long before ``now``."""
        ...

    async def engine_reports(self, now: float) -> list[EngineReport]:
        """The rows still counting at ``now`` (their worker kept reporting), by engine name
        then worker."""
        ...

    async def forget_engines(self, worker: str, engine: str | None = None) -> None:
        """Remove a worker's rows: it stops, and its engines with it (or ``engine`` alone:
        a replica that left its fleet)."""
        ...

    async def running_batches_by_model(self) -> dict[str, int]:
        """Batches that are validating or in progress with lines not done, by model."""
        ...

    async def lane_waits(self) -> dict[tuple[str, str], LaneWait]:
        """Why lanes' batches wait, as the planner last stored it, by (model, org); lanes
        whose batches do not wait, or were claimed from since (``LaneWait.holds``), are left
        out."""
        ...


class EngineConfigStore(Protocol):
    """Engines stored for every worker to serve (docs/fleet.md)."""

    async def stored_engines(self) -> list[StoredEngine]:
        """Every stored engine, by name."""
        ...

    async def stored_engine(self, name: str) -> StoredEngine | None: ...

    async def create_engine(self, engine: StoredEngine) -> bool:
        """Store a new engine; False when its name is taken."""
        ...

    async def write_engine(self, engine: StoredEngine) -> None:
        """Store ``engine`` whether or not one of its name exists."""
        ...

    async def delete_engine(self, name: str) -> bool:
        """Remove the engine; False when there was none."""
        ...


class AuditStore(Protocol):
    """The audit log (domain/audit.py). A change's own row is appended by its transaction; these
    are the rows of actions that never reached a write, their outcomes, reads and retention."""

    async def append_audit(self, entry: AuditEntry) -> int: ...

    async def settle_audit(
        self, entry_id: int, outcome: Outcome, status: int, error: str | None
    ) -> None: ...

    async def audit_page(
        self,
        *,
        before: int | None,
        limit: int,
        org_id: str | None = None,
        action: str | None = None,
        actor: str | None = None,
    ) -> list[AuditEntry]:
        """Newest first, below ``before`` (an id) when given."""
        ...

    async def prune_audit(self, before_at: float) -> int:
        """Removes the rows of actions made before ``before_at``; returns how many."""
        ...


class SpendCapStore(Protocol):
    """Spend caps of orgs and keys (domain/spend_caps.py); admission reads them itself."""

    async def put_spend_cap(self, cap: SpendCap, now: float) -> CapUse:
        """Set the cap of ``cap.scope_id`` for ``cap.period``, replacing the one it had;
        returns it with what its window holds at ``now``."""
        ...

    async def delete_spend_cap(self, scope_id: str, period: Period) -> bool:
        """Remove a cap; False when there was none."""
        ...

    async def spend_cap_uses(self, org_id: str, now: float) -> list[CapUse]:
        """The org's caps and its keys', org first, each with what its window holds at
        ``now``."""
        ...


class BatchControlStore(Protocol):
    """A batch's priority, pause and resume, its org's priority cap, and which batches go
    before others of their org (adapters/db/batch_controls.py)."""

    async def batches_ahead(self, batch_ids: Sequence[str]) -> dict[str, AheadInLane]:
        """Of these running batches, those with no line running whose org has batches of the
        same model that go first (higher priority, or rescued), with what goes first."""
        ...

    async def set_max_priority(self, org_id: str, cap: int) -> bool:
        """False when there is no such org."""
        ...

    async def set_priority(self, batch_id: str, priority: int) -> BatchRecord | None:
        """The batch as stored after; None when it can no longer claim lines."""
        ...

    async def pause(self, batch_id: str, now: int) -> BatchRecord | None: ...

    async def resume(self, batch_id: str) -> BatchRecord | None: ...


class Store(
    TenantStore,
    FileStore,
    CatalogStore,
    LedgerStore,
    BatchStore,
    WorkQueue,
    ResultStore,
    ResultPages,
    OperationsStore,
    NotificationStore,
    OverviewStore,
    EngineHealthStore,
    EngineConfigStore,
    AuditStore,
    SpendCapStore,
    BatchControlStore,
    Protocol,
):
    """Every role at once: what the composition root builds and hands out by role."""

    async def init(self) -> None: ...

    async def close(self) -> None: ...


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
