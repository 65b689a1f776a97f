"""Settling a write's results without a database: counters, charges, receipts and the
reservation release."""

from __future__ import annotations

from backfill.domain.catalog import Billing
from backfill.domain.money import Prices, token_charge
from backfill.domain.records import ItemResult, ReceiptKind
from backfill.domain.settlement import BatchTerms, settle

PRICES = Prices(input=1_000, cached_input=500, output=4_000)


def terms(billing: Billing = Billing.CATALOG, reserved: int = 10**12) -> BatchTerms:
    return BatchTerms(
        id="batch_1",
        org_id="org_1",
        model_config_id="cfg-1",
        billing=billing,
        prices=PRICES if billing == Billing.CATALOG else None,
        reserved=reserved,
    )


def ok(idx: int, tin: int = 100, tout: int = 50, cached: int = 0, at: float = 10.0) -> ItemResult:
    return ItemResult(
        "batch_1",
        idx,
        "token",
        True,
        b"sealed",
        input_tokens=tin,
        output_tokens=tout,
        cached_tokens=cached,
        request_id=f"req_{idx}",
        custom_id=f"c-{idx}",
        finished_at=at,
    )


def failed(idx: int, at: float = 10.0) -> ItemResult:
    return ItemResult("batch_1", idx, "token", False, b"error", finished_at=at)


def test_a_catalog_result_is_charged_at_the_batch_prices_with_a_receipt() -> None:
    result = ok(3, tin=100, tout=50, cached=40, at=123.5)
    settlement = settle(terms(), [result])
    amount = token_charge(PRICES, 100, 40, 50)
    assert amount > 0
    assert (settlement.completed, settlement.failed) == (1, 0)
    assert (settlement.input_tokens, settlement.output_tokens, settlement.cached_tokens) == (
        100,
        50,
        40,
    )
    assert settlement.charged == amount
    [receipt] = settlement.receipts
    assert receipt.kind == ReceiptKind.TOKENS
    assert (receipt.request_id, receipt.org_id, receipt.batch_id, receipt.idx) == (
        "req_3",
        "org_1",
        "batch_1",
        3,
    )
    assert (receipt.custom_id, receipt.model_config_id, receipt.deployment_id) == (
        "c-3",
        "cfg-1",
        None,
    )
    assert (receipt.input_tokens, receipt.cached_tokens, receipt.output_tokens) == (100, 40, 50)
    assert receipt.prices == PRICES
    assert receipt.amount == amount
    assert (receipt.gpu_count, receipt.gpu_ms, receipt.started_at) == (None, None, None)
    assert receipt.created_at == 123.5


def test_cached_tokens_cost_the_cached_price() -> None:
    plain = settle(terms(), [ok(0, tin=100, tout=0, cached=0)]).charged
    cached = settle(terms(), [ok(0, tin=100, tout=0, cached=60)]).charged
    assert cached == token_charge(PRICES, 100, 60, 0)
    assert cached < plain


def test_failures_are_counted_but_never_charged() -> None:
    settlement = settle(terms(), [failed(0), ok(1), failed(2)])
    assert (settlement.completed, settlement.failed) == (1, 2)
    assert [r.idx for r in settlement.receipts] == [1]
    assert settlement.charged == settlement.receipts[0].amount


def test_an_answer_off_its_schema_is_failed_and_charged_as_produced() -> None:
    # output_validation: the engine produced the answer, so it is charged, yet it failed.
    mismatched = ItemResult(
        "batch_1",
        0,
        "token",
        False,
        b"sealed",
        input_tokens=30,
        output_tokens=20,
        cached_tokens=10,
        request_id="req_0",
        custom_id="c-0",
        billed=True,
    )
    settlement = settle(terms(), [mismatched, ok(1), failed(2)])
    assert (settlement.completed, settlement.failed) == (1, 2)
    assert [r.idx for r in settlement.receipts] == [0, 1]
    assert settlement.receipts[0].amount == token_charge(PRICES, 30, 10, 20)
    assert settlement.charged == sum(r.amount for r in settlement.receipts)
    assert (settlement.input_tokens, settlement.output_tokens) == (130, 70)


def test_gpu_time_results_are_counted_without_token_charges() -> None:
    settlement = settle(terms(Billing.GPU_TIME), [ok(0), ok(1, tin=7, tout=9)])
    assert (settlement.completed, settlement.input_tokens, settlement.output_tokens) == (2, 107, 59)
    assert settlement.charged == settlement.released == 0
    assert settlement.receipts == []


def test_a_result_without_a_request_id_is_counted_but_not_charged() -> None:
    result = ItemResult("batch_1", 0, "token", True, b"sealed", 100, 50)
    settlement = settle(terms(), [result])
    assert settlement.completed == 1
    assert (settlement.charged, settlement.receipts) == (0, [])


def test_the_release_is_the_charge_while_the_reservation_lasts() -> None:
    results = [ok(0), ok(1)]
    charged = settle(terms(), results).charged
    assert settle(terms(reserved=10 * charged), results).released == charged
    assert settle(terms(reserved=charged), results).released == charged
    assert settle(terms(reserved=charged - 1), results).released == charged - 1
    assert settle(terms(reserved=0), results).released == 0


def test_receipt_amounts_add_up_to_the_charge() -> None:
    settlement = settle(terms(), [ok(i, tin=10 * i, tout=i, cached=i) for i in range(1, 6)])
    assert settlement.charged == sum(r.amount for r in settlement.receipts)
    assert all(r.prices == PRICES for r in settlement.receipts)


def test_the_settlement_is_stamped_with_its_latest_result() -> None:
    settlement = settle(terms(), [ok(0, at=5.0), failed(1, at=9.0), ok(2, at=7.0)])
    assert settlement.finished_at == 9.0


def test_no_results_settle_nothing() -> None:
    settlement = settle(terms(), [])
    assert not settlement.counted
    assert (settlement.charged, settlement.released, settlement.receipts) == (0, 0, [])
