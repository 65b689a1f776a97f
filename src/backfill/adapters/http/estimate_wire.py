"""The answer of ``POST /v1/batches/estimate``, as msgspec Structs (``/openapi.json`` is generated
from them, like the objects of ``wire.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from backfill.adapters.http.wire import Count, Endpoint, Pricing, Usd
from backfill.domain.catalog import Billing
from backfill.domain.estimates import OutputBasis


class EstimateWorstCase(msgspec.Struct):
    """What creation would reserve: every line at its validation bound of prompt tokens and its
    max_tokens of output."""

    input_tokens: Count
    output_tokens: Count
    cost: Annotated[
        Usd, Meta(description="Reserved at creation (0 for a batch billed by GPU time).")
    ]


class EstimateAnswerSample(msgspec.Struct):
    size: Annotated[
        Count, Meta(description="Successful answers measured (0: none yet, see 'basis').")
    ]
    output_tokens_per_request: Annotated[
        float | None, Meta(description="Their mean output tokens; null without a sample.")
    ]


class EstimateExpected(msgspec.Struct):
    """Input tokens as validation counted them; output tokens from the organization's recent
    answers of the model, or every line's max_tokens while none was measured."""

    input_tokens: Count
    output_tokens: Count
    cost: Annotated[Usd | None, Meta(description="null for a batch billed by GPU time.")]
    basis: OutputBasis
    sample: EstimateAnswerSample


class EstimateRefusal(msgspec.Struct):
    """The error creation would answer now, as its envelope would carry it."""

    status: Annotated[int, Meta(ge=400, le=599, description="The HTTP status it would have.")]
    code: str
    type: str
    message: str
    param: str | None
    retry_after_s: Annotated[
        int | None, Meta(description="The Retry-After it would carry, in seconds.")
    ]


class EstimateAdmission(msgspec.Struct):
    admitted: Annotated[
        bool, Meta(description="Whether credit, spend caps and limits would admit it now.")
    ]
    available_credit: Annotated[Usd, Meta(description="Balance less open reservations.")]
    error: EstimateRefusal | None


class BatchEstimate(msgspec.Struct):
    """What creating a batch with the same body would do now; nothing is stored or reserved."""

    object: Literal["batch.estimate"]
    input_file_id: str
    endpoint: Endpoint
    model: str
    model_config_id: str
    completion_window: str
    expires_at: Annotated[int, Meta(description="The deadline it would get if created now.")]
    request_count: Count
    billing: Billing
    pricing: Pricing | None
    unit: Literal["usd"]
    worst_case: EstimateWorstCase
    expected: EstimateExpected
    admission: EstimateAdmission
    estimated_completion_at: Annotated[
        int | None,
        Meta(
            description="Unix seconds: now, plus the model's engine start if it is stopped, "
            "plus the lines accepted before it and its own over the model's measured rate; "
            "null while the rate is not measured."
        ),
    ]
