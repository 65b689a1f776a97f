"""``POST /v1/batches/estimate``: the create body, answered with what creating it would cost and
decide now; nothing is stored or reserved (docs/api.md, "Estimating a batch").

Included before every router with a ``/v1/batches/{batch_id}`` route, so that the fixed path is
never read as a batch id.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from backfill.adapters.http import estimate_wire as ew
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.presenters import plain, pricing
from backfill.adapters.http.requests import create_batch_request
from backfill.adapters.http.responses import json_response
from backfill.domain.estimates import Estimate
from backfill.domain.money import pico_to_usd
from backfill.errors import BackfillError
from backfill.services.bundle import Services
from backfill.services.tenants import WRITE, Principal

router = APIRouter(prefix="/v1")
Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]


@router.post(
    "/batches/estimate",
    summary="What creating a batch with this body would cost, decide and take; nothing is stored",
)
async def estimate_batch(request: Request, caller: Caller, svc: Svc) -> Response:
    # The scope of creation: the answer says what this key's creation would meet.
    caller.require(WRITE)
    body, _ = create_batch_request(await request.body())
    found = await svc.estimates.estimate(caller.org_id, body, api_key_id=caller.key_id)
    return json_response(estimate_object(found))


def _refusal(exc: BackfillError | None) -> ew.EstimateRefusal | None:
    if exc is None:
        return None
    return ew.EstimateRefusal(
        status=exc.status,
        code=exc.code,
        type=exc.type,
        message=exc.message,
        param=exc.param,
        retry_after_s=exc.retry_after_s,
    )


def estimate_object(e: Estimate) -> dict[str, Any]:
    b, expected = e.batch, e.expected
    mean = expected.sample.mean
    return plain(
        ew.BatchEstimate(
            object="batch.estimate",
            input_file_id=b.input_file_id,
            endpoint=b.endpoint,
            model=b.model,
            model_config_id=b.model_config_id,
            completion_window=b.completion_window,
            expires_at=b.expires_at,
            request_count=b.total,
            billing=b.billing,
            pricing=pricing(b.prices),
            unit="usd",
            worst_case=ew.EstimateWorstCase(
                input_tokens=e.prompt_token_bound,
                output_tokens=b.output_token_bound,
                cost=pico_to_usd(e.reserve),
            ),
            expected=ew.EstimateExpected(
                input_tokens=expected.input_tokens,
                output_tokens=expected.output_tokens,
                cost=None if expected.cost is None else pico_to_usd(expected.cost),
                basis=expected.basis,
                sample=ew.EstimateAnswerSample(
                    size=expected.sample.results,
                    # Two decimals: enough to read, and no float noise in the answer.
                    output_tokens_per_request=None if mean is None else round(mean, 2),
                ),
            ),
            admission=ew.EstimateAdmission(
                admitted=e.refusal is None,
                available_credit=pico_to_usd(e.available),
                error=_refusal(e.refusal),
            ),
            estimated_completion_at=e.completion_at,
        )
    )
