"""GPU time of private deployments: busy while at least one request is in flight (SPEC §7.4).

Time is counted per deployment, not per batch, so overlapping batches of one org are charged
once. Milliseconds come from floored clock readings, so consecutive spans add up exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backfill.domain import ids
from backfill.domain.catalog import CatalogModel
from backfill.domain.money import MAX_GPU_RECEIPT_MS, gpu_time_charge
from backfill.domain.records import Receipt, ReceiptKind
from backfill.ports import Clock, LedgerStore


def _ms(t: float) -> int:
    return int(t * 1000)


@dataclass
class _Span:
    deployment: CatalogModel
    org_id: str
    in_flight: int = 0
    since_ms: int = 0
    started_at: float | None = None
    pending_ms: int = 0


class GpuMeter:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._spans: dict[str, _Span] = {}
        # Called when a span opens: the charging loop, which sleeps while nothing is metered,
        # comes back to its interval.
        self.on_begin: Callable[[], None] = lambda: None

    @property
    def metering(self) -> bool:
        """Whether a span is open or time is left to charge."""
        return any(span.in_flight or span.pending_ms for span in self._spans.values())

    def begin(self, deployment: CatalogModel, org_id: str) -> None:
        span = self._spans.get(deployment.id)
        if span is None:
            span = self._spans[deployment.id] = _Span(deployment, org_id)
        if span.in_flight == 0:
            self.on_begin()
            now = self._clock.now()
            span.since_ms = _ms(now)
            if span.started_at is None:
                span.started_at = now
        span.in_flight += 1

    def end(self, deployment_id: str) -> None:
        span = self._spans[deployment_id]
        span.in_flight -= 1
        if span.in_flight == 0:
            span.pending_ms += _ms(self._clock.now()) - span.since_ms

    def take(self) -> list[Receipt]:
        """Receipts for the GPU time accrued since the last call (open spans included)."""
        now = self._clock.now()
        receipts: list[Receipt] = []
        for span in self._spans.values():
            ms = span.pending_ms
            if span.in_flight:
                ms += _ms(now) - span.since_ms
                span.since_ms = _ms(now)
            span.pending_ms = 0
            if ms <= 0:
                continue
            d = span.deployment
            # A span longer than MAX_GPU_RECEIPT_MS (charging was held up) becomes several
            # receipts, so no one amount can leave its 64-bit column.
            while ms > 0:
                part = min(ms, MAX_GPU_RECEIPT_MS)
                ms -= part
                receipts.append(
                    Receipt(
                        request_id=ids.request_id(),
                        org_id=span.org_id,
                        kind=ReceiptKind.GPU_TIME,
                        batch_id=None,
                        custom_id=None,
                        model_config_id=d.model_config_id,
                        deployment_id=d.id,
                        input_tokens=0,
                        cached_tokens=0,
                        output_tokens=0,
                        prices=None,
                        gpu_count=d.gpu_count,
                        gpu_ms=part,
                        amount=gpu_time_charge(d.gpu_count, d.microusd_per_gpu_second, part),
                        started_at=span.started_at,
                        created_at=now,
                    )
                )
            span.started_at = now if span.in_flight else None
        return receipts


class GpuCharger:
    """Charges the meter's receipts to their orgs; names the orgs left without credit, whose
    GPU-time work must not start more requests until they have some again."""

    def __init__(
        self, meter: GpuMeter, ledger: LedgerStore, on_exhausted: Callable[[set[str]], None]
    ) -> None:
        self._meter = meter
        self._ledger = ledger
        self._on_exhausted = on_exhausted

    @property
    def metering(self) -> bool:
        return self._meter.metering

    async def charge(self) -> None:
        charged = set()
        for receipt in self._meter.take():
            await self._ledger.charge_gpu_time(receipt)
            charged.add(receipt.org_id)
        if charged:
            balances = await self._ledger.balances(sorted(charged))
            exhausted = {org for org, balance in balances.items() if balance <= 0}
            if exhausted:
                self._on_exhausted(exhausted)
