"""``GET /v1/batches/{id}/results``: the rows a batch stored so far, as JSONL (SPEC §4.8)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from backfill.adapters.http.deps import principal, services
from backfill.services.bundle import Services
from backfill.services.results import DEFAULT_LIMIT
from backfill.services.tenants import READ, Principal

router = APIRouter(prefix="/v1")

MEDIA_TYPE = "application/jsonl"
NEXT_CURSOR = "x-backfill-next-cursor"
COMPLETE = "x-backfill-complete"
STATUS = "x-backfill-batch-status"


@router.get(
    "/batches/{batch_id}/results",
    summary="Rows stored so far, as JSONL (resumable with 'after')",
    response_class=Response,
    responses={
        200: {
            "content": {MEDIA_TYPE: {}},
            "description": "Standard output and error rows, one per line. Headers: "
            f"{NEXT_CURSOR} (pass it as 'after' for the next page), {COMPLETE} ('true' once "
            f"the batch is over and every row was served), {STATUS} (the batch's status).",
        }
    },
)
async def batch_results(
    batch_id: str,
    caller: Annotated[Principal, Depends(principal)],
    svc: Annotated[Services, Depends(services)],
    after: str | None = None,
    limit: Annotated[int, Query()] = DEFAULT_LIMIT,
) -> Response:
    caller.require(READ)
    page = await svc.results.page(caller.org_id, batch_id, after, limit)
    body = b"".join(row + b"\n" for row in page.rows)
    return Response(
        body,
        media_type=MEDIA_TYPE,
        headers={
            NEXT_CURSOR: page.next_cursor,
            COMPLETE: "true" if page.complete else "false",
            STATUS: page.status,
            # Rows are added while the batch runs: a cached page would hide them.
            "cache-control": "no-store",
        },
    )
