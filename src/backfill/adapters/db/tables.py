"""The schema: one definition for SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)

from backfill.domain.catalog import Billing
from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS
from backfill.domain.files import FileStatus, InputFormat
from backfill.domain.priority import DEFAULT_MAX_PRIORITY
from backfill.domain.scheduling.claim_model import CHUNK_ORDER, INDEXED_TURN, ChunkState
from backfill.domain.scheduling.planning import NOT_URGENT

metadata = MetaData()

orgs = Table(
    "orgs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("created_at", BigInteger, nullable=False),
    # Picodollars. balance = sum(credits) - sum(receipts); reserved = sum of open reservations.
    Column("balance", BigInteger, nullable=False, server_default="0"),
    Column("reserved", BigInteger, nullable=False, server_default="0"),
    # Its share of dispatch on shared engines, relative to other orgs' (scheduling/fair_share.py).
    Column("weight", Integer, nullable=False, server_default="1"),
    # The Standard Webhooks signing secret, sealed with the master key (it must be read back to
    # sign). The one it replaced, and the one before that, keep signing beside it for a while
    # after the rotation that replaced each (domain/notifications.py, SealedSecrets).
    Column("webhook_secret", LargeBinary),
    Column("webhook_secret_previous", LargeBinary),
    Column("webhook_secret_rotated_at", BigInteger),
    Column("webhook_secret_older", LargeBinary),
    Column("webhook_secret_older_rotated_at", BigInteger),
    # Where terminal-state emails go; null: none.
    Column("notify_email", String(320)),
    # The highest priority its batches may be given (domain/priority.py).
    Column("max_priority", Integer, nullable=False, server_default=str(DEFAULT_MAX_PRIORITY)),
)

# Public model revisions and private deployments (owner_org_id set).
models = Table(
    "models",
    metadata,
    Column("id", String(256), primary_key=True),
    Column("model_config_id", String(256), nullable=False),
    Column("context_length", Integer, nullable=False),
    Column("max_output_tokens", Integer, nullable=False),
    Column("modalities", String(200), nullable=False),
    Column("price_input", BigInteger),
    Column("price_cached_input", BigInteger),
    Column("price_output", BigInteger),
    Column("owner_org_id", String(64), ForeignKey("orgs.id")),
    Column("gpu_count", Integer, nullable=False, server_default="0"),
    Column("microusd_per_gpu_second", BigInteger, nullable=False, server_default="0"),
    Column("throughput_tokens_per_s", BigInteger),
    Column(
        "endpoints",
        String(200),
        nullable=False,
        server_default=",".join(sorted(DEFAULT_MODEL_ENDPOINTS)),
    ),
    Column("updated_at", BigInteger, nullable=False),
)

# Every name a line's body.model may use: each entry's id, and each catalog model's aliases.
# The primary key keeps one name to one model across ids and aliases, whatever writes race.
model_names = Table(
    "model_names",
    metadata,
    Column("name", String(256), primary_key=True),
    Column("model_id", String(256), ForeignKey("models.id"), nullable=False),
    Index("ix_model_names_model", "model_id"),
)

credits = Table(
    "credits",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("note", String(200)),
    Column("created_at", BigInteger, nullable=False),
    Index("ix_credits_org", "org_id"),
)

# One row per charge: a request's tokens, or a span of a private deployment's GPU time.
receipts = Table(
    "receipts",
    metadata,
    Column("request_id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("batch_id", String(64)),
    Column("idx", Integer),
    Column("custom_id", Text),
    Column("model_config_id", String(256)),
    Column("deployment_id", String(256)),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("cached_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("price_input", BigInteger),
    Column("price_cached_input", BigInteger),
    Column("price_output", BigInteger),
    Column("gpu_count", Integer),
    Column("gpu_ms", BigInteger),
    Column("amount", BigInteger, nullable=False),
    Column("started_at", Float),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("batch_id", "idx", name="uq_receipts_item"),
    Index("ix_receipts_org", "org_id"),
)

# Spend caps (domain/spend_caps.py): at most one per org or key (``scope_id``) and period.
spend_caps = Table(
    "spend_caps",
    metadata,
    Column("scope_id", String(64), primary_key=True),
    Column("period", String(8), primary_key=True),
    Column("scope", String(8), nullable=False),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    # Picodollars.
    Column("amount", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Index("ix_spend_caps_org", "org_id"),
)

# What spend caps count, by the window it belongs to: one row per batch (its id, dated at its
# creation) and one per org and UTC day of GPU time (``gpu_<org id>_<day>``, dated at the day's
# start). A running batch's row is ``settled`` false and its amount is read from the batch
# (charged + reserved); at its end ``amount`` becomes what it was charged. Rows outlive deleted
# batches, so deleting a batch never gives back room under a cap.
spend = Table(
    "spend",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    # The key that created the batch; null for GPU time and for batches made before 0018.
    Column("api_key_id", String(64)),
    Column("created_at", BigInteger, nullable=False),
    Column("amount", BigInteger, nullable=False, server_default="0"),
    Column("settled", Boolean, nullable=False),
    Index("ix_spend_org", "org_id", "created_at"),
    Index("ix_spend_key", "api_key_id", "created_at"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    Column("prefix", String(32), nullable=False),
    Column("secret_hash", String(64), nullable=False, unique=True),
    Column("scopes", String(200), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("name", String(200)),
    # A revoked key is refused at once by every API process: the lookup reads this column.
    Column("revoked_at", BigInteger),
    Column("last_used_at", BigInteger),
)

# One row: a check value of the master key that wrote this database's content, so a lost or
# replaced key is refused at start instead of being discovered blob by blob.
keyring = Table(
    "keyring",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("check_value", String(128), nullable=False),
    # The oldest blob format still readable; 2 (bound to its key) once every blob is re-encrypted.
    Column("min_blob_format", SmallInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(256), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger),
    Column("status", String(16), nullable=False),
    Column("lines", Integer, nullable=False, default=0),
    Column("model", String(256)),
    Column("endpoint", String(64)),
    Column("batch_id", String(64)),
    Column("prompt_token_bound", BigInteger, nullable=False, server_default="0"),
    Column("max_output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("input_format", String(32), nullable=False, server_default=InputFormat.JSONL.value),
    # The listing key (``rows.listing_key``): the inserting process's wall clock in ns. List
    # endpoints sort and page by it; it is not a sequence across processes.
    Column("seq", BigInteger, nullable=False),
    Index("ix_files_org_seq", "org_id", "seq"),
    # The janitor's query: live files by expiry, without walking the deleted ones.
    Index(
        "ix_files_expiring",
        "expires_at",
        sqlite_where=text(f"status <> '{FileStatus.DELETED.value}'"),
        postgresql_where=text(f"status <> '{FileStatus.DELETED.value}'"),
    ),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    # The listing key, as for files.
    Column("seq", BigInteger, nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("model", String(256), nullable=False),
    Column("model_config_id", String(256), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(32), nullable=False),
    Column("status", String(16), nullable=False),
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("created_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger),
    Column("expires_at", BigInteger, nullable=False),
    Column("finalizing_at", BigInteger),
    Column("completed_at", BigInteger),
    Column("failed_at", BigInteger),
    Column("expired_at", BigInteger),
    Column("cancelling_at", BigInteger),
    Column("cancelled_at", BigInteger),
    Column("total", Integer, nullable=False),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("input_tokens", BigInteger, nullable=False, default=0),
    Column("output_tokens", BigInteger, nullable=False, default=0),
    Column("errors", JSON),
    Column("metadata", JSON),
    Column("idempotency_key", String(256)),
    Column("request_hash", String(64)),
    Column("billing", String(16), nullable=False, server_default=Billing.CATALOG.value),
    Column("price_input", BigInteger),
    Column("price_cached_input", BigInteger),
    Column("price_output", BigInteger),
    Column("cached_tokens", BigInteger, nullable=False, server_default="0"),
    # Picodollars still reserved for this batch; charged so far.
    Column("reserved", BigInteger, nullable=False, server_default="0"),
    Column("charged", BigInteger, nullable=False, server_default="0"),
    Column("output_token_bound", BigInteger, nullable=False, server_default="0"),
    Column("output_expires_after_s", Integer),
    # The finalize lease: one worker builds and publishes a batch's files (its token names the
    # attempt's blobs, so a late loser never overwrites what was published).
    Column("finalizer", String(32)),
    Column("finalize_until", Float),
    # The planner's projection of when the batch finishes (Unix seconds); null: unknown.
    Column("estimated_completion_at", BigInteger),
    Column("webhook_url", Text),
    # The last ``items.done_seq`` handed out: the result write holds this row's lock while it
    # numbers its rows, so numbers commit in order and a reader's cursor never skips one.
    Column("results_seq", BigInteger, nullable=False, server_default="0"),
    # The batch this one reruns the failed, expired and cancelled lines of.
    Column("retry_of", String(64)),
    # Higher first within its org's lane (domain/priority.py); paused: claims take none of it.
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("paused_at", BigInteger),
    # The planner found it about to miss its window: it goes before higher priorities.
    Column("urgent", Boolean, nullable=False, server_default=false()),
    # Each answer is checked against its line's response_format schema.
    Column("output_validation", Boolean, nullable=False, server_default=false()),
    UniqueConstraint("org_id", "idempotency_key", name="uq_batches_idempotency"),
    Index("ix_batches_org_seq", "org_id", "seq"),
    # The lifecycle reads batches by status, and in-progress ones by deadline: never them all.
    Index("ix_batches_status_expires", "status", "expires_at"),
)

# One row per request line of a batch. Content never lives here in the clear: ``result`` is
# sealed (AES-GCM) by the runner before it is written.
items = Table(
    "items",
    metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("offset", BigInteger, nullable=False),
    Column("length", Integer, nullable=False),
    Column("custom_id", Text, nullable=False),
    Column("state", SmallInteger, nullable=False, default=0),
    Column("lease_token", String(32)),
    Column("lease_until", Float),
    Column("outcome", SmallInteger),
    Column("error_code", String(32)),
    Column("result", LargeBinary),
    Column("input_tokens", Integer),
    Column("output_tokens", Integer),
    # The chunk the line belongs to (null for lines of batches over before chunks existed).
    Column("chunk", Integer),
    # The order results were stored in, per batch (``batches.results_seq``); null for lines
    # closed without a result (never run) and for lines stored before results were numbered.
    Column("done_seq", BigInteger),
    # When its request ended (Unix seconds, the worker's clock; the latest of the results a
    # write stores together, so times never go back along done_seq); null for results
    # stored before times were kept. ``GET /v1/batches/{id}/progress`` reads it.
    Column("done_at", Float),
    # Claims read queued lines of one chunk: (batch_id, state = 0, idx range).
    Index("ix_items_claim", "batch_id", "state", "idx"),
    # Results read while a batch runs (GET /v1/batches/{id}/results), in the order stored.
    # Partial: the lines inserted at batch creation have no number yet and cost it nothing.
    Index(
        "ix_items_results",
        "batch_id",
        "done_seq",
        sqlite_where=text("done_seq IS NOT NULL"),
        postgresql_where=text("done_seq IS NOT NULL"),
    ),
    # A batch's failed lines, for the count of its error codes: partial, so the count reads
    # only failures however many lines succeeded. The query names the outcome as a literal;
    # a bound value would keep both databases from matching the index's condition.
    Index(
        "ix_items_failed",
        "batch_id",
        "idx",
        sqlite_where=text("outcome = 2"),
        postgresql_where=text("outcome = 2"),
    ),
    # Expired leases are put back by a sweep that reads only leased lines.
    Index(
        "ix_items_leased",
        "lease_until",
        sqlite_where=text("state = 1"),
        postgresql_where=text("state = 1"),
    ),
)

# The unit of claim: a range of lines of one batch that starts inside one segment of the input,
# so the lines a claim hands out are read with one ranged read. ``state``: a ChunkState, 0
# ready (it holds queued lines), 1 taken (all its lines are leased or done). Only running
# batches have chunks: they are deleted when the batch stops running.
chunks = Table(
    "chunks",
    metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("chunk", Integer, primary_key=True),
    Column("first_idx", Integer, nullable=False),
    Column("end_idx", Integer, nullable=False),
    Column("model", String(256), nullable=False),
    Column("org_id", String(64), nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    # Lower first: the batch's claim rank (domain/priority.py, claim_rank).
    Column("rank", Integer, nullable=False, server_default="0"),
    Column("state", SmallInteger, nullable=False, server_default="0"),
    # A line released with a backoff holds its whole chunk back until then.
    Column("not_before", Float),
    # A lane's ready chunks in the claim's order (claim_model.CHUNK_ORDER).
    Index(
        "ix_chunks_ready",
        "model",
        "org_id",
        *CHUNK_ORDER,
        sqlite_where=text(f"state = {ChunkState.READY:d}"),
        postgresql_where=text(f"state = {ChunkState.READY:d}"),
    ),
)

# One lane per (model, org). The claim serves urgent lanes first (earliest ``urgent_by``), then
# the ready lanes with the least virtual time ``vtime`` (lines claimed / the org's weight).
# ``served`` counts the lines claimed from it; ``ready`` the lane's chunks in state 0.
lanes = Table(
    "lanes",
    metadata,
    Column("model", String(256), primary_key=True),
    Column("org_id", String(64), primary_key=True),
    # GPU-time lanes pause while their org has no credit (SPEC §7.4).
    Column("metered", Boolean, nullable=False, server_default=false()),
    Column("served", BigInteger, nullable=False, server_default="0"),
    Column("ready", Integer, nullable=False, server_default="0"),
    Column("vtime", Float, nullable=False, server_default="0"),
    # The deadline of the lane's batch the planner found about to miss it; NOT_URGENT otherwise.
    Column("urgent_by", BigInteger, nullable=False, server_default=str(NOT_URGENT)),
    # ``served`` at the planner's last pass, and the lane's part of what its model served since.
    Column("served_mark", BigInteger, nullable=False, server_default="0"),
    Column("share", Float, nullable=False, server_default="0"),
    # Why the lane's batches wait, as the planner last found it (domain/scheduling/waits.py):
    # a ``waiting_on`` code, the pass that first found it, and the facts its message quotes.
    Column("waiting_code", String(32)),
    Column("waiting_since", BigInteger),
    Column("waiting_detail", JSON),
    # The ready lanes of a model in turn order (claim_model.TURN_ORDER, less its tie-breaks).
    Index(
        "ix_lanes_turn",
        "model",
        *INDEXED_TURN,
        sqlite_where=text("ready > 0"),
        postgresql_where=text("ready > 0"),
    ),
)

# Each model's measured throughput (requests per second while it had work), kept by the
# planner and read by admission in every API process.
model_rates = Table(
    "model_rates",
    metadata,
    Column("model", String(256), primary_key=True),
    Column("rps", Float),
    # Where the current measurement window starts: when, the lines claimed by then, busy then.
    Column("observed_at", Float, nullable=False),
    Column("served", BigInteger, nullable=False),
    Column("busy", Boolean, nullable=False),
    # Replicas up when the window started, and the rate one replica serves (null: unmeasured).
    Column("replicas", Integer, nullable=False, server_default="0"),
    Column("rps_per_replica", Float),
)

# Webhook endpoints an org registered for batch events (OpenAI's event names).
webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("orgs.id"), nullable=False),
    Column("url", Text, nullable=False),
    # Comma-separated event types, e.g. "batch.completed,batch.failed".
    Column("events", String(200), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Index("ix_webhook_endpoints_org", "org_id"),
)

# The notification outbox: one row per message to send (a batch's webhook, an org endpoint's
# event, an email), written in the transaction that ends the batch. ``state``: 0 pending,
# 1 delivered, 2 given up. A sender leases a row for one attempt, so one process sends it.
notifications = Table(
    "notifications",
    metadata,
    # The webhook-id of every attempt of this message.
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), nullable=False),
    Column("batch_id", String(64), nullable=False),
    Column("channel", String(16), nullable=False),
    Column("endpoint_id", String(64)),
    Column("target", Text, nullable=False),
    Column("event", String(32), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("state", SmallInteger, nullable=False, server_default="0"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("next_at", Float, nullable=False),
    Column("lease_token", String(32)),
    Column("lease_until", Float),
    Column("last_status_code", Integer),
    Column("last_error", String(300)),
    Column("last_attempt_at", BigInteger),
    Column("delivered_at", BigInteger),
    Index("ix_notifications_batch", "batch_id"),
    # The senders' query: pending rows by when they may be tried next.
    Index(
        "ix_notifications_due",
        "next_at",
        sqlite_where=text("state = 0"),
        postgresql_where=text("state = 0"),
    ),
)

# Work that one process at a time does for everyone (the janitor): a named lease.
singletons = Table(
    "singletons",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("holder", String(32), nullable=False),
    Column("until", Float, nullable=False),
)

# Each worker's view of its engines (domain/engine_health.py), so that API processes without a
# worker show engine health too. Written when a health check changes what it says and at every
# lease heartbeat; a row whose ``until`` passed belongs to a worker that stopped reporting.
# Engines every worker serves, managed at run time (docs/fleet.md): each one's settings as
# the config file's [[engines]] table writes them, its API key sealed under the master key.
engines = Table(
    "engines",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("api_key_sealed", LargeBinary),
    Column("enabled", Boolean, nullable=False),
    Column("source", String(16), nullable=False),
    Column("updated_at", Float, nullable=False),
)

engine_health = Table(
    "engine_health",
    metadata,
    Column("worker", Text, primary_key=True),
    Column("engine", Text, primary_key=True),
    Column("url", Text),
    Column("models", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("last_error", Text),
    Column("since", Float, nullable=False),
    Column("checked_at", Float),
    Column("in_flight", Integer, nullable=False),
    Column("max_concurrency", Integer, nullable=False),
    Column("concurrency_limit", Integer, nullable=False),
    Column("mode", String(16), nullable=False),
    Column("signal", String(16), nullable=False),
    Column("pressure", Float, nullable=False),
    Column("until", Float, nullable=False),
    # Whether the engine applies the request priority Backfill sends ("applied", "ignored"),
    # as its probe found; null: not probed or not known yet.
    Column("priority", String(16)),
    # How long the engine's starts on demand took to answer, as its worker learnt (seconds).
    Column("start_s", Float),
    # Up, but taking no batch work now (domain/engine_health.py, Hold): why, since when, the
    # next retry and the status answered (a rate limit); null: it takes what its limit allows.
    Column("hold", String(32)),
    Column("hold_since", Float),
    Column("hold_until", Float),
    Column("hold_status", Integer),
)

# The audit log (domain/audit.py): one row per admin action or state-changing key use. Ids
# grow with time (pages go by id); ``at`` is when the request came in.
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("at", Float, nullable=False),
    Column("actor", String(64), nullable=False),
    Column("org_id", String(64)),
    Column("action", String(64), nullable=False),
    Column("target", String(256)),
    Column("address", String(64)),
    Column("outcome", String(16), nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("error", String(64)),
    Index("ix_audit_log_at", "at"),
    Index("ix_audit_log_org", "org_id", "id"),
)
