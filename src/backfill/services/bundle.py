"""The services one process offers, as the container builds them for the API and the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from backfill.services.account import AccountService
from backfill.services.audit import AuditLog
from backfill.services.batch_controls import BatchControls
from backfill.services.batches import BatchService
from backfill.services.billing import BillingService
from backfill.services.catalog import CatalogService
from backfill.services.engine_admin import EngineAdmin
from backfill.services.error_codes import ErrorCodeService
from backfill.services.estimates import EstimateService
from backfill.services.files import FileService
from backfill.services.fleet import FleetService
from backfill.services.notifications import NotificationService
from backfill.services.operations import Operations
from backfill.services.reruns import RerunService
from backfill.services.results import ResultService
from backfill.services.spend_caps import SpendCapService
from backfill.services.tenants import TenantService


@dataclass(frozen=True, slots=True)
class Services:
    tenants: TenantService
    files: FileService
    batches: BatchService
    catalog: CatalogService
    billing: BillingService
    operations: Operations
    notifications: NotificationService
    results: ResultService
    reruns: RerunService
    account: AccountService
    fleet: FleetService
    error_codes: ErrorCodeService
    engines: EngineAdmin
    audit: AuditLog
    spend_caps: SpendCapService
    controls: BatchControls
    estimates: EstimateService
