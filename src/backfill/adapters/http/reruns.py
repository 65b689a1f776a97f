"""Routes that act on an ended batch: rerun its failed lines, delete it (SPEC §4.8)."""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
import orjson
from fastapi import APIRouter, Depends, Header, Request
from starlette.responses import Response

from backfill.adapters.http.audit import audited
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.presenters import batch_object
from backfill.adapters.http.requests import FIELD_RULES, json_object
from backfill.adapters.http.responses import json_response
from backfill.domain.decode_errors import Broken, explain
from backfill.domain.reruns import RETRY_FIELDS, RetryBatchRequest
from backfill.errors import InvalidInput
from backfill.services.bundle import Services
from backfill.services.tenants import WRITE, Principal

router = APIRouter(prefix="/v1")
Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]


def retry_batch_request(batch_id: str, raw: bytes) -> tuple[RetryBatchRequest, str]:
    """The optional body of a retry (none, or ``{}``: everything as the batch had it), and
    its hash: an Idempotency-Key replay must name the same batch with the same body."""
    body = json_object(raw, "a JSON object (or empty)") if raw.strip() else {}
    try:
        request = msgspec.convert(body, RetryBatchRequest)
    except msgspec.ValidationError as exc:
        problem = explain(exc)
        field = problem.field or ""
        if problem.broken is Broken.UNKNOWN:
            raise InvalidInput(
                f"Unknown field '{problem.param}'; a retry takes {list(RETRY_FIELDS)}, each "
                "defaulting to the batch's own.",
                code="unknown_parameter",
                param=problem.param,
            ) from None
        rule = FIELD_RULES.get(field)
        if rule is not None:
            # The field's own rule, shared with creation, says what is wrong in its words.
            rule(body.get(field))
        raise InvalidInput(
            f"The request body is not a retry: {problem.reason}.",
            code="invalid_value",
            param=problem.param,
        ) from None
    # Checked as creation checks them (metadata limits, expiry range).
    FIELD_RULES["metadata"](body.get("metadata"))
    if isinstance(request.output_expires_after, msgspec.Struct):
        FIELD_RULES["output_expires_after"](body.get("output_expires_after"))
    canonical = orjson.dumps({"retry_of": batch_id, "body": body}, option=orjson.OPT_SORT_KEYS)
    return request, hashlib.sha256(canonical).hexdigest()


@router.post(
    "/batches/{batch_id}/retry",
    summary="Rerun an ended batch's failed lines",
    dependencies=[audited("batch.retry", "batch_id")],
)
async def retry_batch(
    batch_id: str,
    request: Request,
    caller: Caller,
    svc: Svc,
    idempotency_key: Annotated[str | None, Header(alias="idempotency-key")] = None,
) -> Response:
    caller.require(WRITE)
    body, request_hash = retry_batch_request(batch_id, await request.body())
    batch, _ = await svc.reruns.retry(
        caller.org_id, batch_id, body, idempotency_key, request_hash, api_key_id=caller.key_id
    )
    return json_response(batch_object(batch))


@router.delete(
    "/batches/{batch_id}",
    summary="Delete an ended batch and its content",
    dependencies=[audited("batch.delete", "batch_id")],
)
async def delete_batch(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    deleted = await svc.reruns.delete(caller.org_id, batch_id)
    return json_response({"id": deleted, "object": "batch.deleted", "deleted": True})
