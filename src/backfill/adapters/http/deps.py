"""What route handlers get injected: the services and the caller's identity."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from backfill.services.batches import BatchService
from backfill.services.billing import BillingService
from backfill.services.catalog import CatalogService
from backfill.services.files import FileService
from backfill.services.operations import Operations
from backfill.services.tenants import Principal, TenantService


@dataclass(frozen=True, slots=True)
class Services:
    tenants: TenantService
    files: FileService
    batches: BatchService
    catalog: CatalogService
    billing: BillingService
    operations: Operations


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


async def principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    token = secret.strip() if scheme.lower() == "bearer" else None
    return await services(request).tenants.authenticate(token or None)
