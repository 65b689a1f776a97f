"""What storing a batch's results settles: its counters, its charges and receipts, and the part
of its reservation those charges use up.

Pure: the store calls ``settle`` inside the transaction that accepts the results and only
persists the ``Settlement``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backfill.domain.catalog import Billing
from backfill.domain.money import Prices, token_charge
from backfill.domain.records import ItemResult, Receipt, ReceiptKind


@dataclass(frozen=True, slots=True)
class BatchTerms:
    """What settling needs to know about a batch, read with its row locked."""

    id: str
    org_id: str
    model_config_id: str
    billing: Billing
    prices: Prices | None
    reserved: int
    """Picodollars the batch still holds of its org's balance."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """What one write's accepted results add to their batch and take from its org."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    charged: int = 0
    """Picodollars charged, the sum of ``receipts``."""
    released: int = 0
    """Picodollars of the reservation these charges use up: ``min(charged, reserved)``."""
    receipts: list[Receipt] = field(default_factory=list)
    finished_at: float = 0.0
    """When the latest of these results finished: the batch's finalizing time if they end it."""

    @property
    def counted(self) -> bool:
        return bool(self.completed or self.failed)


def settle(terms: BatchTerms, results: Sequence[ItemResult]) -> Settlement:
    """Count ``results`` (accepted, of the batch ``terms`` describes) and charge the successful
    ones of a catalog batch at its prices; failures are never charged, but for answers the
    engine produced that did not match their line's schema (``billed``): those count as failed
    and are charged, their tokens in the batch's usage."""
    prices = terms.prices if terms.billing == Billing.CATALOG else None
    completed = failed = tokens_in = tokens_out = cached = charged = 0
    receipts: list[Receipt] = []
    finished_at = 0.0
    for r in results:
        finished_at = max(finished_at, r.finished_at)
        if r.ok:
            completed += 1
        else:
            failed += 1
            if not r.billed:
                continue
        tokens_in += r.input_tokens
        tokens_out += r.output_tokens
        cached += r.cached_tokens
        request_id = r.request_id
        if prices is None or request_id is None:
            continue
        amount = token_charge(prices, r.input_tokens, r.cached_tokens, r.output_tokens)
        charged += amount
        receipts.append(_receipt(terms, prices, r, request_id, amount))
    return Settlement(
        completed=completed,
        failed=failed,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        cached_tokens=cached,
        charged=charged,
        released=min(charged, terms.reserved),
        receipts=receipts,
        finished_at=finished_at,
    )


def _receipt(
    terms: BatchTerms, prices: Prices, r: ItemResult, request_id: str, amount: int
) -> Receipt:
    return Receipt(
        request_id=request_id,
        org_id=terms.org_id,
        kind=ReceiptKind.TOKENS,
        batch_id=terms.id,
        custom_id=r.custom_id,
        model_config_id=terms.model_config_id,
        deployment_id=None,
        input_tokens=r.input_tokens,
        cached_tokens=r.cached_tokens,
        output_tokens=r.output_tokens,
        prices=prices,
        gpu_count=None,
        gpu_ms=None,
        amount=amount,
        started_at=None,
        created_at=r.finished_at,
        idx=r.idx,
    )
