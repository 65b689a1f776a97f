"""Failures inside the worker's own request path (SPEC §9.6, §7.3): a database error on the way
to the engine gives the engine slot and the lease back; engine-reported usage cannot overflow a
column or credit an org; a request that keeps failing inside Backfill ends as an error row
instead of being retried until its window ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import orjson
from sqlalchemy import select

from backfill.adapters.clock import SystemClock
from backfill.adapters.db import tables as t
from backfill.domain.catalog import CatalogModel
from backfill.domain.money import MAX_TOKENS, Prices, token_charge
from backfill.errors import StorageError
from backfill.ports import Catalog, EngineReply
from tests.integration.test_gpu_time import (
    DEPLOYMENT,
    created,
    fleet,
    private_line,
)
from tests.support import (
    SIM_MODEL,
    SIM_PRICES,
    InProcess,
    assert_exactly_once,
    chat_line,
    in_process_backfill,
)


class CatalogFailingOnce:
    """The real catalog, whose next read fails as a lost database connection would."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self.failures_left = 1

    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        if self.failures_left:
            self.failures_left -= 1
            raise StorageError("The database failed while reading the catalog: OSError.")
        return await self._catalog.find(name, org_id)

    async def all(self, org_id: str | None = None) -> list[CatalogModel]:
        return await self._catalog.all(org_id)


async def test_catalog_read_failing_before_a_gpu_time_request_releases_its_slot(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, clock=SystemClock(), private_concurrency=1) as f:
        worker = f.bf.backfill.worker
        assert worker is not None
        failing = CatalogFailingOnce(worker.parts.requests._catalog)
        worker.parts.requests._catalog = failing
        rows = [private_line(f"g{i}", f"gpu {i}") for i in range(3)]
        batch = await created(f.bf, rows)

        done = await f.bf.wait(batch["id"], timeout_s=30)
        assert failing.failures_left == 0, "the catalog read never failed"
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        # With one slot, a leaked slot would have left nothing to run the batch on.
        [private] = [s for s in worker.parts.pool.slots if s.engine.serves(DEPLOYMENT)]
        assert private.in_flight == 0


# ---- what the engine answers cannot break the books ---------------------------------------

HUGE = 2**70


class UsageEngine:
    """An OpenAI-compatible engine in process whose reported usage the prompt chooses:
    ``huge`` reports 2**70 of every count, ``negative`` -5, ``boom`` makes the engine client
    fail with an error Backfill does not expect; anything else 3 prompt and 4 output tokens."""

    name = "usage"
    max_concurrency = 8

    def __init__(self) -> None:
        self.booms = 0

    models = (SIM_MODEL,)

    def serves(self, model: str) -> bool:
        return model == SIM_MODEL

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    async def send(self, path: str, model: str, body: dict[str, Any]) -> EngineReply:
        # The body holds the line's fields still encoded (msgspec.Raw), as engines send them.
        sent = orjson.loads(msgspec.json.encode(body))
        prompt = sent["messages"][0]["content"]
        if prompt == "boom":
            self.booms += 1
            raise RuntimeError("the engine client tripped over this request")
        counts = {"huge": (HUGE, HUGE, HUGE), "negative": (-5, -5, -5)}.get(prompt, (3, 4, 0))
        usage = (
            f'{{"prompt_tokens": {counts[0]}, "completion_tokens": {counts[1]}, '
            f'"prompt_tokens_details": {{"cached_tokens": {counts[2]}}}}}'
        )
        reply = (
            '{"object": "chat.completion", "choices": [{"index": 0, "message": {"role": '
            f'"assistant", "content": "ok"}}, "finish_reason": "stop"}}], "usage": {usage}}}'
        )
        return EngineReply(200, reply.encode())


async def receipts(bf: InProcess, batch_id: str) -> dict[str, Any]:
    r = t.receipts
    async with bf.backfill.store.engine.connect() as conn:
        rows = (await conn.execute(select(r).where(r.c.batch_id == batch_id))).all()
    return {row.custom_id: row for row in rows}


async def test_engine_usage_out_of_range_is_clamped_and_never_credits(
    tmp_path: Path, sim: Any
) -> None:
    rows = [
        chat_line("huge", "huge"),
        chat_line("negative", "negative"),
        *(chat_line(f"n{i}", f"normal {i}") for i in range(5)),
    ]
    async with in_process_backfill(tmp_path, sim[0], engines=[UsageEngine()]) as bf:
        batch = await bf.run_batch(rows, timeout_s=30)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 7, "completed": 7, "failed": 0}
        out, err = await bf.rows(batch["output_file_id"]), await bf.rows(batch["error_file_id"])
        assert_exactly_once(rows, out, err)

        prices = Prices.of(SIM_PRICES.input, SIM_PRICES.cached_input, SIM_PRICES.output)
        charged = await receipts(bf, batch["id"])
        huge, negative = charged["huge"], charged["negative"]
        assert (huge.input_tokens, huge.cached_tokens, huge.output_tokens) == (MAX_TOKENS,) * 3
        assert huge.amount == token_charge(prices, MAX_TOKENS, MAX_TOKENS, MAX_TOKENS)
        assert (negative.input_tokens, negative.output_tokens, negative.amount) == (0, 0, 0)
        assert all(row.amount >= 0 for row in charged.values())
        assert batch["usage"]["input_tokens"] == MAX_TOKENS + 5 * 3

        org = await bf.backfill.store.org_by_name("default")
        assert org is not None
        ledger = await bf.backfill.store.ledger(org.id)
        assert ledger.reserved == 0
        assert ledger.charges == sum(row.amount for row in charged.values())
        assert ledger.balance == ledger.credits - ledger.charges


async def test_request_failing_again_and_again_inside_backfill_ends_as_an_error_row(
    tmp_path: Path, sim: Any
) -> None:
    engine = UsageEngine()
    rows = [chat_line("boom", "boom"), *(chat_line(f"n{i}", f"normal {i}") for i in range(5))]
    async with in_process_backfill(tmp_path, sim[0], engines=[engine]) as bf:
        worker = bf.backfill.worker
        assert worker is not None
        worker.parts.failures.give_up_span_s = 0.3
        batch = await bf.run_batch(rows, timeout_s=30)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        out, err = await bf.rows(batch["output_file_id"]), await bf.rows(batch["error_file_id"])
        assert_exactly_once(rows, out, err)
        [given_up] = err
        assert given_up["custom_id"] == "boom"
        assert given_up["response"] is None
        assert given_up["error"]["code"] == "internal_error"
        assert "failed repeatedly inside Backfill" in given_up["error"]["message"]
        assert engine.booms >= worker.parts.failures.give_up_after
        org = await bf.backfill.store.org_by_name("default")
        assert org is not None
        assert (await bf.backfill.store.ledger(org.id)).reserved == 0
