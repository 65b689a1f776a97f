"""The JSON objects of the public API, as msgspec Structs: ``/openapi.json`` is generated from them.

A field without a default is always present in the answer; ``UNSET`` marks a key that may be
left out. Constraints (``Meta``) and docstrings become the JSON Schema's bounds and descriptions,
so a wire change is made here once and the document follows.
"""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from backfill.adapters.http.requests import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
)
from backfill.domain.catalog import Billing
from backfill.domain.endpoints import ENDPOINTS
from backfill.domain.files import MAX_EXPIRY_S, MIN_EXPIRY_S, FilePurpose, FileStatus
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.notifications import Channel
from backfill.domain.priority import MAX_PRIORITY, MIN_PRIORITY
from backfill.domain.progress import MAX_POINTS
from backfill.domain.spend_caps import CapScope, Period
from backfill.domain.waiting import PRECEDENCE

T = TypeVar("T")

Count = Annotated[int, Meta(ge=0)]
Usd = Annotated[str, Meta(description="An exact decimal amount of USD.")]
# The set is configuration-free but not a Literal, so the enum is spelled from it.
Endpoint = Annotated[str, Meta(extra_json_schema={"enum": sorted(ENDPOINTS)})]
Deleted = Annotated[bool, Meta(extra_json_schema={"const": True})]
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=MAX_METADATA_KEY)],
        Annotated[str, Meta(max_length=MAX_METADATA_VALUE)],
    ],
    Meta(
        max_length=MAX_METADATA_PAIRS,
        description=f"Up to {MAX_METADATA_PAIRS} string pairs, keys up to "
        f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}.",
    ),
]


class ErrorBody(msgspec.Struct):
    message: Annotated[str, Meta(min_length=1)]
    type: str
    param: str | None
    code: str | None
    line: (
        Annotated[
            int, Meta(ge=1, description="The input line at fault, for file validation errors.")
        ]
        | UnsetType
    ) = UNSET


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """The OpenAI error envelope."""

    error: ErrorBody


class ListOf(msgspec.Struct, Generic[T]):
    object: Literal["list"]
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool


class File(msgspec.Struct):
    id: str
    object: Literal["file"]
    bytes: Count
    created_at: int
    expires_at: int | None
    filename: str
    purpose: FilePurpose
    status: FileStatus
    status_details: None


class FileDeleted(msgspec.Struct):
    id: str
    object: Literal["file"]
    deleted: Deleted


class Pricing(msgspec.Struct):
    """Prices per token, as decimal strings in 'unit'."""

    unit: str
    input: str
    cached_input: str
    output: str


class RequestCounts(msgspec.Struct):
    total: Count
    completed: Count
    failed: Count


class BatchError(msgspec.Struct):
    code: str
    message: str
    param: str | UnsetType | None = UNSET
    line: int | UnsetType | None = UNSET


class BatchErrors(msgspec.Struct):
    object: Literal["list"]
    data: list[BatchError]


class InputTokensDetails(msgspec.Struct):
    cached_tokens: Count


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: Count


class BatchUsage(msgspec.Struct):
    input_tokens: Count
    input_tokens_details: InputTokensDetails
    output_tokens: Count
    output_tokens_details: OutputTokensDetails
    total_tokens: Count


class WaitingOn(msgspec.Struct):
    """Why the batch makes no progress now, until it resumes (docs/api.md, "Why a batch
    waits")."""

    # Spelled as a schema enum: new codes may come (a client should show the message of one
    # it does not know), and the domain keeps codes as strings (domain/waiting.py).
    code: Annotated[str, Meta(extra_json_schema={"enum": [c.value for c in PRECEDENCE]})]
    message: str
    since: Annotated[int, Meta(description="Unix seconds: when this reason began to hold.")]
    resumes_at: Annotated[
        int | None,
        Meta(
            description="Unix seconds: when the batch is expected to move again (an engine's "
            "next retry, a start's learnt length); null when no fact says."
        ),
    ]


class BatchCost(msgspec.Struct):
    """What a batch billed by tokens has cost so far and still holds reserved (docs/api.md)."""

    unit: Literal["usd"]
    charged: Annotated[Usd, Meta(description="The sum of its receipts so far.")]
    reserved: Annotated[Usd, Meta(description="Still held of the credit; 0 once it ended.")]


class Batch(msgspec.Struct):
    id: str
    object: Literal["batch"]
    endpoint: Endpoint
    model: str | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    errors: BatchErrors | None
    metadata: Metadata | None
    usage: BatchUsage
    model_config_id: str | None
    billing: Billing
    pricing: Pricing | None
    webhook_url: str | None
    retry_of: Annotated[
        str | None, Meta(description="The batch whose unsucceeded lines this one reruns.")
    ]
    estimated_completion_at: int | None
    waiting_on: WaitingOn | None
    priority: Annotated[
        int, Meta(description="Higher runs first among the org's batches of the same model.")
    ]
    paused_at: Annotated[
        int | None,
        Meta(description="When the batch was paused (it claims no new lines); null: running."),
    ]
    output_validation: Annotated[
        bool, Meta(description="Each answer is checked against its line's response_format.")
    ]
    cost: Annotated[
        BatchCost | None,
        Meta(description="null for a batch billed by GPU time (charged per deployment)."),
    ]


class BatchDeleted(msgspec.Struct):
    id: str
    object: Literal["batch.deleted"]
    deleted: Deleted


class BatchNotification(msgspec.Struct):
    id: str
    object: Literal["batch.notification"]
    batch_id: str
    channel: Channel
    event: str
    target: str
    endpoint_id: str | None
    status: Literal["pending", "delivered", "failed"]
    attempts: Count
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: int | None
    next_attempt_at: int | None
    delivered_at: int | None
    created_at: int


class ModelBatch(msgspec.Struct):
    modalities: list[str]
    endpoints: list[str]
    billing: Billing
    pricing: Pricing | None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    model_config_id: str | None
    context_length: Count
    max_output_tokens: Count
    modalities: list[str]
    batch: ModelBatch | None
    aliases: list[str]


class ReceiptUsage(msgspec.Struct):
    input_tokens: Count
    input_tokens_details: InputTokensDetails
    output_tokens: Count
    total_tokens: Count


class Money(msgspec.Struct):
    unit: Literal["picousd"]
    value: str
    usd: str


class Receipt(msgspec.Struct):
    object: Literal["receipt"]
    request_id: str
    kind: str
    batch_id: str | None
    custom_id: str | None
    model_config_id: str | None
    deployment_id: str | None
    usage: ReceiptUsage
    pricing: Pricing | None
    gpu_count: int | None
    gpu_ms: int | None
    amount: Money
    started_at: float | None
    created_at: float


Priority = Annotated[
    int,
    Meta(
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher runs first among the org's batches of the model; at most the org's "
        "max_priority.",
    ),
]


class OutputExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Meta(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


class CreateBatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: Endpoint
    completion_window: Annotated[
        str, Meta(description="A duration such as '24h', '48h' or '7d'.")
    ] = "24h"
    metadata: Metadata | UnsetType | None = UNSET
    webhook_url: (
        Annotated[
            str | None, Meta(description="An HTTPS URL on a public host, told when the batch ends.")
        ]
        | UnsetType
    ) = UNSET
    output_expires_after: OutputExpiresAfter | UnsetType | None = UNSET
    priority: Priority | UnsetType = UNSET
    output_validation: (
        Annotated[bool, Meta(description="Check each answer against its line's response_format.")]
        | UnsetType
    ) = UNSET


class UpdateBatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    priority: Priority


class RetryBatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Every field is optional; one left out is taken from the batch rerun."""

    completion_window: str | UnsetType = UNSET
    metadata: Metadata | UnsetType | None = UNSET
    output_expires_after: OutputExpiresAfter | UnsetType | None = UNSET


class UploadForm(msgspec.Struct):
    purpose: Literal["batch"]
    file: Annotated[str, Meta(extra_json_schema={"format": "binary"})]
    expires_after_anchor: Literal["created_at"] | UnsetType = msgspec.field(
        default=UNSET, name="expires_after[anchor]"
    )
    expires_after_seconds: Annotated[str, Meta(pattern="^[0-9]+$")] | UnsetType = msgspec.field(
        default=UNSET, name="expires_after[seconds]"
    )


class KeyOrganization(msgspec.Struct):
    id: str
    name: str


class ApiKey(msgspec.Struct):
    id: str
    object: Literal["api_key"]
    name: str | None
    prefix: str
    scopes: list[str]
    created_at: int
    organization: KeyOrganization


class Credit(msgspec.Struct):
    unit: Literal["usd"]
    credits: Usd
    charges: Usd
    balance: Usd
    reserved: Usd
    available: Usd


class SpendCap(msgspec.Struct):
    """A spend cap of the org or of one of its keys, with what its current window holds
    (docs/billing.md, "Spend caps")."""

    id: Annotated[
        str, Meta(description="The capped org's or key's id and the period, e.g. key_…:day.")
    ]
    object: Literal["spend_cap"]
    scope: CapScope
    key_id: Annotated[str | None, Meta(description="The capped key's id; null for the org.")]
    period: Period
    unit: Literal["usd"]
    limit: Usd
    charged: Annotated[Usd, Meta(description="Charged in the window so far.")]
    reserved: Annotated[Usd, Meta(description="Still reserved by the window's running batches.")]
    left: Annotated[Usd, Meta(description="limit - charged - reserved, at least 0.")]
    window_start: Annotated[
        int | None, Meta(description="Unix seconds (UTC); null for a total cap.")
    ]
    resets_at: Annotated[int | None, Meta(description="Unix seconds (UTC); null for a total cap.")]
    updated_at: int


class Organization(msgspec.Struct):
    id: str
    object: Literal["organization"]
    name: str
    created_at: int
    credit: Credit
    spend_caps: list[SpendCap]


class LedgerEntry(msgspec.Struct):
    id: str
    object: Literal["ledger_entry"]
    type: Literal["credit", "batch"]
    created_at: int
    amount: Money
    note: str | None
    batch_id: str | None
    batch_status: str | None
    model: str | None
    reserved: Money | None


class BatchCharges(msgspec.Struct):
    id: str
    object: Literal["batch.charges"]
    status: BatchStatus
    billing: Billing
    charged: Money
    reserved: Money


class ErrorCodeCount(msgspec.Struct):
    code: str
    count: Annotated[int, Meta(ge=1)]


class BatchErrorCodes(msgspec.Struct):
    object: Literal["batch.error_codes"]
    batch_id: str
    data: list[ErrorCodeCount]
    rows_read: Count
    truncated: bool
    complete: bool


class ProgressPoint(msgspec.Struct):
    at: Annotated[float, Meta(description="Unix seconds.")]
    done: Annotated[int, Meta(ge=1, description="Results stored (completed and failed) by 'at'.")]


class BatchProgress(msgspec.Struct):
    object: Literal["batch.progress"]
    batch_id: str
    total: Count
    points: Annotated[
        list[ProgressPoint],
        Meta(
            max_length=MAX_POINTS,
            description="By 'done', increasing; empty while no result is stored and for "
            "results stored before their times were kept.",
        ),
    ]
