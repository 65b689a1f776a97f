"""Routes of a running batch's controls: ``POST /v1/batches/{id}`` (its priority), and
``/pause`` and ``/resume`` (docs/api.md, "Priority and pause").

Included after every other ``/v1/batches/...`` route, so that a fixed path such as
``/v1/batches/estimate`` is never read as a batch id.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from backfill.adapters.http.audit import audited
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.presenters import batch_object
from backfill.adapters.http.requests import json_object
from backfill.adapters.http.responses import json_response
from backfill.errors import InvalidInput
from backfill.services.bundle import Services
from backfill.services.tenants import WRITE, Principal

router = APIRouter(prefix="/v1")
Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]

# What a running batch's update may change.
UPDATABLE = ("priority",)


@router.post(
    "/batches/{batch_id}",
    summary="Change a running batch's priority",
    dependencies=[audited("batch.update", "batch_id")],
)
async def update_batch(batch_id: str, request: Request, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    body = _update_body(await request.body())
    batch = await svc.controls.set_priority(caller.org_id, batch_id, body["priority"])
    return json_response(batch_object(batch))


@router.post(
    "/batches/{batch_id}/pause",
    summary="Pause a batch: it starts no new request until resumed",
    dependencies=[audited("batch.pause", "batch_id")],
)
async def pause_batch(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    return json_response(batch_object(await svc.controls.pause(caller.org_id, batch_id)))


@router.post(
    "/batches/{batch_id}/resume",
    summary="Resume a paused batch",
    dependencies=[audited("batch.resume", "batch_id")],
)
async def resume_batch(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    return json_response(batch_object(await svc.controls.resume(caller.org_id, batch_id)))


def _update_body(raw: bytes) -> dict[str, Any]:
    body = json_object(raw, 'a JSON object such as {"priority": 5}')
    unknown = sorted(set(body) - set(UPDATABLE))
    if unknown:
        raise InvalidInput(
            f"Unknown field '{unknown[0]}'; a running batch's update takes only {list(UPDATABLE)}.",
            code="unknown_parameter",
            param=unknown[0],
        )
    if "priority" not in body:
        raise InvalidInput(
            "'priority' is required: the batch's new priority (higher runs first).",
            code="missing_required_parameter",
            param="priority",
        )
    return body
