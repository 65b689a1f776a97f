"""What a key reads about itself and its org, for the dashboard and any client: the key's
scopes, the org's credit and ledger, its batches' charges, a batch's error codes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from backfill.adapters.http import wire
from backfill.adapters.http.auth import bearer
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.presenters import (
    api_key_object,
    list_object,
    money,
    plain,
    spend_cap,
)
from backfill.adapters.http.responses import json_response
from backfill.domain.money import pico_to_usd
from backfill.domain.overview import BatchCharges, EntryKind, LedgerEntry, OrgAccount
from backfill.services.bundle import Services
from backfill.services.tenants import READ, Principal

router = APIRouter(prefix="/v1")
Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]


def entry_object(entry: LedgerEntry) -> dict[str, Any]:
    charge = entry.kind == EntryKind.BATCH
    return plain(
        wire.LedgerEntry(
            id=entry.id,
            object="ledger_entry",
            type=entry.kind.value,
            created_at=int(entry.created_at),
            # Charges leave the balance: signed, so a column of amounts adds up.
            amount=money(-entry.amount if charge else entry.amount),
            note=entry.note,
            batch_id=entry.id if charge else None,
            batch_status=entry.status,
            model=entry.model,
            reserved=money(entry.reserved) if charge else None,
        )
    )


def charges_object(charges: BatchCharges) -> dict[str, Any]:
    return plain(
        wire.BatchCharges(
            id=charges.id,
            object="batch.charges",
            status=charges.status,
            billing=charges.billing,
            charged=money(charges.charged),
            reserved=money(charges.reserved),
        )
    )


def credit(account: OrgAccount) -> wire.Credit:
    """The org's credit in USD, as ``GET /admin/v1/orgs/{name}/ledger`` shows it; ``charges``
    is ``credits - balance`` (docs/api.md)."""
    return wire.Credit(
        unit="usd",
        credits=pico_to_usd(account.credits),
        charges=pico_to_usd(account.charges),
        balance=pico_to_usd(account.balance),
        reserved=pico_to_usd(account.reserved),
        available=pico_to_usd(account.available),
    )


@router.get("/api_key", summary="The API key this request carries: its scopes and organization")
async def api_key(request: Request, caller: Caller, svc: Svc) -> Response:
    del caller  # authenticated (and its use recorded) by the dependency
    secret = bearer(request.scope["headers"]) or b""
    found = await svc.account.identity(secret.decode("latin-1"))
    return json_response(
        {
            **api_key_object(found.key),
            "organization": {"id": found.org.id, "name": found.org.name},
        }
    )


@router.get("/organization", summary="The caller's organization, its credit and its spend caps")
async def organization(caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    account = await svc.account.organization(caller.org_id)
    caps = await svc.spend_caps.uses(caller.org_id)
    return json_response(
        plain(
            wire.Organization(
                id=account.org.id,
                object="organization",
                name=account.org.name,
                created_at=account.org.created_at,
                credit=credit(account),
                spend_caps=[spend_cap(use) for use in caps],
            )
        )
    )


@router.get("/organization/ledger", summary="Credits and batch charges, newest first")
async def ledger(
    caller: Caller,
    svc: Svc,
    limit: Annotated[int, Query()] = 20,
    after: str | None = None,
) -> Response:
    caller.require(READ)
    page = await svc.account.ledger_entries(caller.org_id, after, limit)
    return json_response(list_object([entry_object(e) for e in page.items], page.has_more))


@router.get(
    "/organization/batch_charges",
    summary="What each named batch was charged so far and still holds reserved",
)
async def batch_charges(caller: Caller, svc: Svc, ids: str = "") -> Response:
    caller.require(READ)
    wanted = [part for part in (p.strip() for p in ids.split(",")) if part]
    found = await svc.account.batch_charges(caller.org_id, wanted)
    return json_response(list_object([charges_object(c) for c in found], False))


@router.get(
    "/batches/{batch_id}/error_codes",
    summary="How many of the batch's lines failed, by error code",
)
async def error_codes(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    found = await svc.error_codes.count(caller.org_id, batch_id)
    return json_response(
        plain(
            wire.BatchErrorCodes(
                object="batch.error_codes",
                batch_id=batch_id,
                data=[
                    wire.ErrorCodeCount(code=code, count=count)
                    for code, count in found.counts.items()
                ],
                rows_read=found.read,
                truncated=found.truncated,
                complete=found.complete,
            )
        )
    )
