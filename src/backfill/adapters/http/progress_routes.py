"""``GET /v1/batches/{id}/progress``: how many requests were done over time, from the times
the batch's results were stored (the dashboard's chart draws it)."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Depends
from starlette.responses import Response

from backfill.adapters.http import wire
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.presenters import plain
from backfill.services.bundle import Services
from backfill.services.tenants import READ, Principal

router = APIRouter(prefix="/v1")


@router.get(
    "/batches/{batch_id}/progress",
    summary="Requests done over time, from when the batch's results were stored",
)
async def batch_progress(
    batch_id: str,
    caller: Annotated[Principal, Depends(principal)],
    svc: Annotated[Services, Depends(services)],
) -> Response:
    caller.require(READ)
    found = await svc.results.progress(caller.org_id, batch_id)
    body = wire.BatchProgress(
        object="batch.progress",
        batch_id=batch_id,
        total=found.total,
        points=[wire.ProgressPoint(at=point.at, done=point.done) for point in found.points],
    )
    return Response(
        orjson.dumps(plain(body)),
        media_type="application/json",
        # Points are added while the batch runs: a cached answer would hide them.
        headers={"cache-control": "no-store"},
    )
