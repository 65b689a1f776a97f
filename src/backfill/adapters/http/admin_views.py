"""Admin views for the dashboard under /admin/v1: every org with its credit, the queue by
model with what it asks of each model's fleet. Engines are ``GET /admin/v1/engines``
(admin.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from backfill.adapters.http.admin import org_object, require_admin
from backfill.adapters.http.deps import services
from backfill.adapters.http.presenters import list_object
from backfill.adapters.http.responses import json_response
from backfill.domain.money import pico_to_usd
from backfill.domain.overview import ModelQueue, OrgCredit
from backfill.domain.scheduling.demand import ModelDemand
from backfill.services.bundle import Services

router = APIRouter(prefix="/admin/v1", include_in_schema=False)
Admin = Annotated[None, Depends(require_admin)]
Svc = Annotated[Services, Depends(services)]


def org_credit_object(found: OrgCredit) -> dict[str, Any]:
    return {
        **org_object(found.org),
        "credit": {
            "unit": "usd",
            "balance": pico_to_usd(found.balance),
            "reserved": pico_to_usd(found.reserved),
            "available": pico_to_usd(found.available),
        },
    }


def queue_object(queue: ModelQueue) -> dict[str, Any]:
    found: dict[str, Any] = {
        "object": "queue.model",
        "model": queue.model,
        "batches": queue.batches,
        "in_progress": queue.in_progress,
        "remaining_requests": queue.remaining,
        "requests_per_s": queue.requests_per_s,
    }
    if queue.demand is not None:
        found.update(demand_fields(queue.demand))
    return found


def demand_fields(demand: ModelDemand) -> dict[str, Any]:
    """What the model's queue asks of its fleet (docs/api.md, "Admin: organizations' credit
    and the queue")."""
    return {
        "queued_requests": demand.queued_requests,
        "queued_tokens_bound": demand.queued_tokens_bound,
        "replicas": demand.replicas,
        "requests_per_s_per_replica": demand.per_replica_rps,
        "replicas_needed": demand.replicas_needed,
        "deadline_margin_fraction": demand.deadline_margin_fraction,
    }


def queue_list(found: list[ModelQueue]) -> dict[str, Any]:
    """``GET /admin/v1/queue``'s answer, which ``backfill admin queue --json`` prints too."""
    return {"object": "list", "data": [queue_object(q) for q in found], "has_more": False}


@router.get("/orgs")
async def list_orgs(
    _: Admin, svc: Svc, limit: Annotated[int, Query()] = 20, after: str | None = None
) -> Response:
    page = await svc.fleet.org_credits(after, limit)
    return json_response(list_object([org_credit_object(o) for o in page.items], page.has_more))


@router.get("/queue")
async def queue(_: Admin, svc: Svc) -> Response:
    return json_response(queue_list(await svc.fleet.queue()))
