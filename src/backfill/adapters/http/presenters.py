"""Records as the JSON objects the OpenAI API returns."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from backfill.adapters.http import wire
from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.files import FileRecord
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import Prices, pico_to_usd
from backfill.domain.notifications import DeliveryState, Notification
from backfill.domain.records import ApiKey, BatchRecord, Receipt
from backfill.domain.spend_caps import CapScope, CapUse


def plain(obj: msgspec.Struct) -> dict[str, Any]:
    """``obj`` as the dict the routes encode: field order kept, unset keys left out."""
    out: dict[str, Any] = msgspec.to_builtins(obj)
    return out


def pricing(prices: Prices | None) -> wire.Pricing | None:
    return None if prices is None else wire.Pricing(**prices.as_api())


def file_object(record: FileRecord) -> dict[str, Any]:
    return plain(
        wire.File(
            id=record.id,
            object="file",
            bytes=record.bytes,
            created_at=record.created_at,
            expires_at=record.expires_at,
            filename=record.filename,
            purpose=record.purpose,
            status=record.status,
            status_details=None,
        )
    )


def batch_object(b: BatchRecord) -> dict[str, Any]:
    w = b.waiting_on
    return plain(
        wire.Batch(
            id=b.id,
            object="batch",
            endpoint=b.endpoint,
            model=b.model,
            input_file_id=b.input_file_id,
            completion_window=b.completion_window,
            status=b.status,
            output_file_id=b.output_file_id,
            error_file_id=b.error_file_id,
            created_at=b.created_at,
            in_progress_at=b.in_progress_at,
            expires_at=b.expires_at,
            finalizing_at=b.finalizing_at,
            completed_at=b.completed_at,
            failed_at=b.failed_at,
            expired_at=b.expired_at,
            cancelling_at=b.cancelling_at,
            cancelled_at=b.cancelled_at,
            request_counts=wire.RequestCounts(
                total=b.total, completed=b.completed, failed=b.failed
            ),
            errors=(
                wire.BatchErrors(
                    object="list", data=[msgspec.convert(e, wire.BatchError) for e in b.errors]
                )
                if b.errors
                else None
            ),
            metadata=b.metadata,
            usage=wire.BatchUsage(
                input_tokens=b.input_tokens,
                input_tokens_details=wire.InputTokensDetails(cached_tokens=b.cached_tokens),
                output_tokens=b.output_tokens,
                output_tokens_details=wire.OutputTokensDetails(reasoning_tokens=0),
                total_tokens=b.input_tokens + b.output_tokens,
            ),
            model_config_id=b.model_config_id,
            billing=b.billing,
            pricing=pricing(b.prices),
            webhook_url=b.webhook_url,
            # The batch whose failed, expired and cancelled lines this one reruns.
            retry_of=b.retry_of,
            # Kept by the planner while the batch runs; before and after, there is none.
            estimated_completion_at=(
                b.estimated_completion_at if b.status == BatchStatus.IN_PROGRESS else None
            ),
            # Why it makes no progress now (domain/waiting.py, docs/api.md).
            waiting_on=(
                wire.WaitingOn(
                    code=w.code, message=w.message, since=w.since, resumes_at=w.resumes_at
                )
                if w is not None
                else None
            ),
            priority=b.priority,
            paused_at=b.paused_at,
            output_validation=b.output_validation,
            cost=batch_cost(b),
        )
    )


def batch_cost(b: BatchRecord) -> wire.BatchCost | None:
    """Its receipts so far and what it still holds, read with the batch (one row): a GPU-time
    batch's charges are per deployment, not per batch, so it has none to show."""
    if b.billing == Billing.GPU_TIME:
        return None
    return wire.BatchCost(
        unit="usd", charged=pico_to_usd(b.charged), reserved=pico_to_usd(b.reserved)
    )


def model_object(m: CatalogModel) -> dict[str, Any]:
    batch: dict[str, Any] | None = None
    if m.private:
        batch = {
            "modalities": sorted(m.modalities),
            "endpoints": sorted(m.endpoints),
            "billing": "gpu_time",
            "pricing": None,
        }
    elif m.prices is not None:
        batch = {
            "modalities": sorted(m.modalities),
            "endpoints": sorted(m.endpoints),
            "billing": "catalog",
            "pricing": m.prices.as_api(),
        }
    data: dict[str, Any] = {
        "id": m.id,
        "object": "model",
        "created": 0,
        "owned_by": m.owner_org_id or "backfill",
        "model_config_id": m.model_config_id,
        "context_length": m.context_length,
        "max_output_tokens": m.max_output_tokens,
        "modalities": sorted(m.modalities),
        "batch": batch,
        # The other names lines may use for it (exact, case-sensitive); listed here rather than
        # as entries of their own, so the list has one entry, and one price, per model.
        "aliases": sorted(m.aliases),
    }
    if m.private:
        data["deployment"] = {
            "gpu_count": m.gpu_count,
            "microusd_per_gpu_second": str(m.microusd_per_gpu_second),
        }
    else:
        data["throughput_tokens_per_s"] = m.throughput_tokens_per_s
    return data


def money(pico: int) -> wire.Money:
    """An amount as receipts show it: exact picodollars and the same in USD."""
    return wire.Money(unit="picousd", value=str(pico), usd=pico_to_usd(pico))


def money_object(pico: int) -> dict[str, str]:
    return plain(money(pico))


def receipt_object(r: Receipt) -> dict[str, Any]:
    return plain(
        wire.Receipt(
            object="receipt",
            request_id=r.request_id,
            kind=r.kind,
            batch_id=r.batch_id,
            custom_id=r.custom_id,
            model_config_id=r.model_config_id,
            deployment_id=r.deployment_id,
            usage=wire.ReceiptUsage(
                input_tokens=r.input_tokens,
                input_tokens_details=wire.InputTokensDetails(cached_tokens=r.cached_tokens),
                output_tokens=r.output_tokens,
                total_tokens=r.input_tokens + r.output_tokens,
            ),
            pricing=pricing(r.prices),
            gpu_count=r.gpu_count,
            gpu_ms=r.gpu_ms,
            amount=money(r.amount),
            started_at=r.started_at,
            created_at=r.created_at,
        )
    )


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return plain(
        wire.ListOf(
            object="list",
            data=data,
            first_id=data[0]["id"] if data else None,
            last_id=data[-1]["id"] if data else None,
            has_more=bool(has_more),
        )
    )


_DELIVERY: dict[DeliveryState, Literal["pending", "delivered", "failed"]] = {
    DeliveryState.PENDING: "pending",
    DeliveryState.DELIVERED: "delivered",
    DeliveryState.GIVEN_UP: "failed",
}


def notification_object(n: Notification) -> dict[str, Any]:
    """One notification of a batch and where its delivery stands (docs/notifications.md)."""
    pending = n.state == DeliveryState.PENDING
    return plain(
        wire.BatchNotification(
            id=n.id,
            object="batch.notification",
            batch_id=n.batch_id,
            channel=n.channel,
            event=n.event,
            target=n.target,
            endpoint_id=n.endpoint_id,
            status=_DELIVERY[n.state],
            attempts=n.attempts,
            last_status_code=n.last_status_code,
            last_error=n.last_error,
            last_attempt_at=n.last_attempt_at,
            next_attempt_at=int(n.next_at) if pending else None,
            delivered_at=n.delivered_at,
            created_at=n.created_at,
        )
    )


def spend_cap(use: CapUse) -> wire.SpendCap:
    """A cap and its current window, as ``GET /v1/organization`` and the admin API show it."""
    cap, span = use.cap, use.window
    return wire.SpendCap(
        id=f"{cap.scope_id}:{cap.period.value}",
        object="spend_cap",
        scope=cap.scope,
        key_id=cap.scope_id if cap.scope == CapScope.KEY else None,
        period=cap.period,
        unit="usd",
        limit=pico_to_usd(cap.limit),
        charged=pico_to_usd(use.charged),
        reserved=pico_to_usd(use.reserved),
        left=pico_to_usd(use.left),
        window_start=None if span.resets_at is None else span.start,
        resets_at=span.resets_at,
        updated_at=cap.updated_at,
    )


def spend_cap_object(use: CapUse) -> dict[str, Any]:
    return plain(spend_cap(use))


def api_key_object(key: ApiKey) -> dict[str, Any]:
    """A key as the API shows it to its holder and to an admin: never its secret."""
    return {
        "id": key.id,
        "object": "api_key",
        "name": key.name,
        "prefix": key.prefix,
        "scopes": sorted(key.scopes),
        "created_at": key.created_at,
    }
