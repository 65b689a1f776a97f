"""Spend caps under /admin/v1, mirroring ``backfill admin spend-cap`` (docs/billing.md,
"Spend caps"): an org's caps and its keys', each with what its current window holds."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from backfill.adapters.http.admin import require_admin
from backfill.adapters.http.audit import audited
from backfill.adapters.http.deps import services
from backfill.adapters.http.presenters import list_object, spend_cap_object
from backfill.adapters.http.responses import json_response
from backfill.domain.spend_caps import CapScope
from backfill.services.bundle import Services

router = APIRouter(prefix="/admin/v1", include_in_schema=False)
Admin = Annotated[None, Depends(require_admin)]
Svc = Annotated[Services, Depends(services)]


class CapIn(BaseModel):
    # The amount's type and range are checked by the service, so the CLI and the API give
    # the same answer; an unknown field is refused, never ignored.
    model_config = ConfigDict(extra="forbid")
    usd: Any


def removed(scope: CapScope, org: str | None, key_id: str | None, period: str) -> dict[str, Any]:
    return {
        "object": "spend_cap.deleted",
        "scope": scope.value,
        "org": org,
        "key_id": key_id,
        "period": period,
        "deleted": True,
    }


@router.get("/orgs/{name}/spend_caps")
async def list_caps(name: str, _: Admin, svc: Svc) -> Response:
    uses = await svc.spend_caps.org_caps(name)
    return json_response(list_object([spend_cap_object(u) for u in uses], False))


@router.put("/orgs/{name}/spend_caps/{period}", dependencies=[audited("spend_cap.set", "name")])
async def put_org_cap(name: str, period: str, body: CapIn, _: Admin, svc: Svc) -> Response:
    return json_response(spend_cap_object(await svc.spend_caps.set_org_cap(name, period, body.usd)))


@router.delete(
    "/orgs/{name}/spend_caps/{period}", dependencies=[audited("spend_cap.delete", "name")]
)
async def delete_org_cap(name: str, period: str, _: Admin, svc: Svc) -> Response:
    await svc.spend_caps.remove_org_cap(name, period)
    return json_response(removed(CapScope.ORG, name, None, period))


@router.put("/keys/{key_id}/spend_caps/{period}", dependencies=[audited("spend_cap.set", "key_id")])
async def put_key_cap(key_id: str, period: str, body: CapIn, _: Admin, svc: Svc) -> Response:
    use = await svc.spend_caps.set_key_cap(key_id, period, body.usd)
    return json_response(spend_cap_object(use))


@router.delete(
    "/keys/{key_id}/spend_caps/{period}", dependencies=[audited("spend_cap.delete", "key_id")]
)
async def delete_key_cap(key_id: str, period: str, _: Admin, svc: Svc) -> Response:
    await svc.spend_caps.remove_key_cap(key_id, period)
    return json_response(removed(CapScope.KEY, None, key_id, period))
