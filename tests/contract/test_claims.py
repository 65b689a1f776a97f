"""Claims at scale, on SQLite and PostgreSQL: a chunk at a time, fair across orgs, never
reading a batch's finished lines, and lines that go back to the queue are found again."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from sqlalchemy import Select, text

from backfill.adapters.db.claims import expired_leases, queued_lines
from backfill.adapters.db.store import SqlStore
from backfill.domain.chunks import CHUNK_LINES, INPUT_SEGMENT_BYTES, Chunker
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.lines import LineRef
from backfill.domain.scheduling.claim_model import LANES_PER_CLAIM
from tests.contract.test_store import LEASE, NOW, make_batch, make_org, ok, take


async def plan_of(store: SqlStore, statement: Select[Any]) -> str:
    """The query plan of the statement the store really runs, with its values inlined;
    PostgreSQL is told to avoid sequential scans so a tiny table shows the plan a big one
    gets (SQLite plans by indexes and query shape alone)."""
    compiled = str(
        statement.compile(dialect=store.engine.dialect, compile_kwargs={"literal_binds": True})
    )
    async with store.engine.connect() as conn:
        if store.is_sqlite:
            rows = await conn.execute(text("EXPLAIN QUERY PLAN " + compiled))
            return " ".join(str(row[-1]) for row in rows)
        await conn.execute(text("SET enable_seqscan = off"))
        rows = await conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + compiled))
        return " ".join(str(row[0]) for row in rows)


def test_chunks_start_inside_one_segment_and_hold_at_most_chunk_lines() -> None:
    size = 300_000  # about three and a half lines per segment
    lines = [LineRef(i, i * size, size, f"r{i}") for i in range(40)]
    chunker = Chunker()
    chunks = [*chunker.feed(lines[:13]), *chunker.feed(lines[13:]), *chunker.close()]
    assert [line for c in chunks for line in c.lines] == lines
    for chunk in chunks:
        segments = {line.offset // INPUT_SEGMENT_BYTES for line in chunk.lines}
        assert len(segments) == 1
        assert chunk.chunk == chunk.lines[0].idx
    small = [LineRef(i, i * 10, 10, f"r{i}") for i in range(CHUNK_LINES * 2 + 1)]
    chunker = Chunker()
    assert [len(c.lines) for c in [*chunker.feed(small), *chunker.close()]] == [
        CHUNK_LINES,
        CHUNK_LINES,
        1,
    ]


async def test_a_claim_takes_lines_of_one_chunk_and_claimers_take_disjoint_chunks(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, CHUNK_LINES * 6)
    claims = await asyncio.gather(
        *(store.claim([batch.model], CHUNK_LINES, f"token-{n}", NOW + LEASE, NOW) for n in range(6))
    )
    got = [claim for made in claims for claim in made]
    chunks = [claim.chunk for claim in got]
    assert len(chunks) == len(set(chunks))  # no two claims share a chunk
    for claim in got:
        assert {item.chunk for item in claim.items} == {claim.chunk}
        assert claim.batch.id == batch.id
        assert claim.batch.org_id == org.id
    idxs = sorted(item.idx for claim in got for item in claim.items)
    assert idxs == sorted(set(idxs))


async def test_claims_take_turns_between_orgs(store: SqlStore) -> None:
    """One org with a big batch does not hold back another that arrives later."""
    big_org, small_org = await make_org(store), await make_org(store)
    big = await make_batch(store, big_org, 2000, model="shared")
    served: Counter[str] = Counter()
    for _ in range(3):
        for claim in await store.claim(["shared"], 20, "t", NOW + LEASE, NOW):
            served[claim.batch.org_id] += len(claim.items)
    small = await make_batch(store, small_org, 2000, model="shared")
    served.clear()
    for _ in range(20):
        for claim in await store.claim(["shared"], 20, "t", NOW + LEASE, NOW):
            served[claim.batch.org_id] += len(claim.items)
    # Level shares from the start: the newcomer neither waits nor catches up with a burst.
    assert abs(served[big.org_id] - served[small.org_id]) <= 20
    assert served[small.org_id] > 0


async def test_one_claim_serves_many_orgs_in_one_statement_without_shrinking(
    store: SqlStore,
) -> None:
    orgs = [await make_org(store) for _ in range(LANES_PER_CLAIM * 3)]
    for org in orgs:
        await make_batch(store, org, 50, model="many")
    claims = await store.claim(["many"], 64, "t", NOW + LEASE, NOW)
    assert len({c.batch.org_id for c in claims}) == LANES_PER_CLAIM
    assert sum(len(c.items) for c in claims) == 64


async def test_a_gpu_time_lane_without_credit_is_not_claimed(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 3)
    async with store.engine.begin() as conn:
        await conn.execute(text("UPDATE lanes SET metered = true"))
    assert await take(store, batch, 3, "t", NOW + LEASE, NOW) == []
    async with store.engine.begin() as conn:
        await conn.execute(text("UPDATE orgs SET balance = 5"))
    assert len(await take(store, batch, 3, "t", NOW + LEASE, NOW)) == 3


async def test_released_and_expired_lines_reopen_their_chunk(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 4)
    items = await take(store, batch, 4, "a", NOW + LEASE, NOW)
    assert await take(store, batch, 4, "b", NOW + LEASE, NOW) == []
    await store.release(batch.id, items[1].idx, "a")
    assert [i.idx for i in await take(store, batch, 4, "b", NOW + LEASE, NOW)] == [1]
    later = NOW + LEASE + 1
    assert await store.requeue_expired(later) == 4
    again = await take(store, batch, 4, "c", later + LEASE, later)
    assert [i.idx for i in again] == [0, 1, 2, 3]
    assert await store.write_results([ok(i, "c") for i in again]) == [True] * 4


async def test_a_cancelled_batch_is_not_claimed_and_its_lane_empties(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, CHUNK_LINES * 2)
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], "cancelling", 3)
    assert await take(store, batch, 10, "t", NOW + LEASE, NOW) == []
    async with store.engine.connect() as conn:
        ready = (await conn.execute(text("SELECT sum(ready) FROM lanes"))).scalar()
        chunks = (await conn.execute(text("SELECT count(*) FROM chunks"))).scalar()
    assert (ready, chunks) == (0, 0)


async def test_claims_do_not_read_finished_lines(store: SqlStore) -> None:
    """The claim's plan reads queued lines of one chunk through the claim index, however many
    lines of the batch are done (a batch used to get slower as it drained)."""
    org = await make_org(store)
    batch = await make_batch(store, org, CHUNK_LINES * 4)
    done = await take(store, batch, CHUNK_LINES * 3, "t", NOW + LEASE, NOW)
    assert await store.write_results([ok(i, "t") for i in done]) == [True] * len(done)
    statement = queued_lines(batch.id, CHUNK_LINES * 3, CHUNK_LINES * 4, NOW, 64)
    plan = await plan_of(store, statement)
    assert "ix_items_claim" in plan, plan
    assert "SCAN" not in plan, plan
    assert "Rows Removed by Filter" not in plan, plan
    assert len(await take(store, batch, CHUNK_LINES, "t", NOW + LEASE, NOW)) == CHUNK_LINES


async def test_the_expiry_sweep_reads_only_leased_lines(store: SqlStore) -> None:
    org = await make_org(store)
    await make_batch(store, org, 50)
    plan = await plan_of(store, expired_leases(NOW))
    assert "ix_items_leased" in plan, plan


async def test_lease_renewal_reads_only_the_leases_it_names(store: SqlStore) -> None:
    """The heartbeat's statement finds its lines by primary key: its cost does not grow with
    the lines the database has ever held."""
    org = await make_org(store)
    batch = await make_batch(store, org, 50)
    sql = (
        "UPDATE items SET lease_until = :until WHERE batch_id = :b AND idx IN (1, 2, 3)"
        " AND lease_token = :t AND state = 1"
    )
    params = {"until": NOW, "b": batch.id, "t": "t"}
    async with store.engine.connect() as conn:
        if store.is_sqlite:
            plan = " ".join(
                str(row[-1])
                for row in await conn.execute(text("EXPLAIN QUERY PLAN " + sql), params)
            )
            assert "SCAN" not in plan, plan
        else:
            await conn.execute(text("SET enable_seqscan = off"))
            plan = " ".join(
                str(row[0]) for row in await conn.execute(text("EXPLAIN " + sql), params)
            )
            # By key, or through the partial index that holds only leased lines.
            assert any(ix in plan for ix in ("items_pkey", "ix_items_claim", "ix_items_leased"))
            assert "Seq Scan" not in plan, plan


async def test_ready_models_are_those_a_claim_could_take_now(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2, model="waiting")
    await make_batch(store, org, 2, model="paused", status=BatchStatus.CANCELLING)
    assert await store.ready_models(["waiting", "paused", "none"], NOW) == {"waiting"}
    # Every line taken, then one given back for a retry after a backoff: not ready until then.
    items = await take(store, batch, 2, "t", NOW + LEASE, NOW)
    assert await store.ready_models(["waiting"], NOW) == set()
    await store.release(batch.id, items[0].idx, "t", NOW + 60)
    assert await store.ready_models(["waiting"], NOW) == set()
    assert await store.ready_models(["waiting"], NOW + 61) == {"waiting"}
