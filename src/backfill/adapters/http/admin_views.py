"""Admin views for the dashboard under /admin/v1: every org with its credit, the queue by
model. Engines are ``GET /admin/v1/engines`` (admin.py)."""

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
    return {
        "object": "queue.model",
        "model": queue.model,
        "batches": queue.batches,
        "in_progress": queue.in_progress,
        "remaining_requests": queue.remaining,
        "requests_per_s": queue.requests_per_s,
    }


@router.get("/orgs")
async def list_orgs(
    _: Admin, svc: Svc, limit: Annotated[int, Query()] = 20, after: str | None = None
) -> Response:
    page = await svc.fleet.org_credits(after, limit)
    return json_response(list_object([org_credit_object(o) for o in page.items], page.has_more))


@router.get("/queue")
async def queue(_: Admin, svc: Svc) -> Response:
    found = await svc.fleet.queue()
    data = [queue_object(q) for q in found]
    return json_response({"object": "list", "data": data, "has_more": False})
