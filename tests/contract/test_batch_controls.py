"""A batch's controls in the store, on SQLite and PostgreSQL: priority orders a lane's claims
at once; the planner's rescue puts a batch about to miss its window first and back; a paused
batch's returning lines wait; and what ``waiting_on: priority`` reads (``batches_ahead``).
(Claims against the reference model with priorities and pauses: test_claim_model.py.)"""

from __future__ import annotations

from sqlalchemy import text

from backfill.adapters.db.store import SqlStore
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.priority import URGENT_RANK
from backfill.domain.scheduling.planning import Plan
from tests.contract.test_store import LEASE, NOW, make_batch, make_org


async def ranks(store: SqlStore, batch_id: str) -> set[int]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT DISTINCT rank FROM chunks WHERE batch_id = :b"), {"b": batch_id}
        )
        return {int(row.rank) for row in rows}


async def lane_ready(store: SqlStore, model: str) -> int:
    async with store.engine.connect() as conn:
        found = await conn.execute(text("SELECT ready FROM lanes WHERE model = :m"), {"m": model})
        return int(found.scalar_one())


async def claimed_from(store: SqlStore, model: str, token: str) -> list[str]:
    claims = await store.claim([model], 1, token, NOW + LEASE, NOW)
    return [claim.batch.id for claim in claims]


async def test_a_higher_priority_goes_first_at_once_and_a_rescue_before_it(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    first = await make_batch(store, org, 10, model="m-prio", expires_at=int(NOW) + 1000)
    later = await make_batch(store, org, 10, model="m-prio", expires_at=int(NOW) + 2000)
    assert await claimed_from(store, "m-prio", "t1") == [first.id]  # earliest deadline

    raised = await store.set_priority(later.id, 5)
    assert raised is not None
    assert raised.priority == 5
    assert await ranks(store, later.id) == {-5}
    assert await claimed_from(store, "m-prio", "t2") == [later.id]

    # The planner rescues the first: before every priority, then back when safe.
    await store.apply_plan(Plan([], [], {}, urgent=frozenset({first.id})))
    assert await ranks(store, first.id) == {URGENT_RANK}
    assert (await store.get_batch(None, first.id)).urgent  # type: ignore[union-attr]
    assert await claimed_from(store, "m-prio", "t3") == [first.id]
    # A rescued batch's priority change keeps its rescue.
    await store.set_priority(first.id, 1)
    assert await ranks(store, first.id) == {URGENT_RANK}
    await store.apply_plan(Plan([], [], {}, calm=frozenset({first.id})))
    assert await ranks(store, first.id) == {-1}
    assert await claimed_from(store, "m-prio", "t4") == [later.id]


async def test_a_paused_batch_claims_nothing_and_a_returning_line_waits_for_resume(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 4, model="m-pause")
    claims = await store.claim(["m-pause"], 4, "t1", NOW + LEASE, NOW)
    assert sum(len(c.items) for c in claims) == 4  # the whole chunk is out: taken
    paused = await store.pause(batch.id, int(NOW))
    assert paused is not None
    assert paused.paused_at == int(NOW)
    # A line comes back while paused: its chunk waits, uncounted by the lane.
    await store.release(batch.id, 0, "t1")
    assert await lane_ready(store, "m-pause") == 0
    assert await store.claim(["m-pause"], 4, "t2", NOW + LEASE, NOW) == []
    assert await store.ready_models(["m-pause"], NOW) == set()

    resumed = await store.resume(batch.id)
    assert resumed is not None
    assert resumed.paused_at is None
    assert await lane_ready(store, "m-pause") == 1
    again = await store.claim(["m-pause"], 4, "t2", NOW + LEASE, NOW)
    assert [item.idx for c in again for item in c.items] == [0]

    # Over: no control applies.
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], "finalizing", 3)
    assert await store.pause(batch.id, int(NOW)) is None
    assert await store.resume(batch.id) is None
    assert await store.set_priority(batch.id, 3) is None


async def test_a_batch_paused_while_validating_starts_paused(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 3, model="m-valid", status=BatchStatus.VALIDATING)
    assert await store.pause(batch.id, int(NOW)) is not None
    assert await store.transition(batch.id, [BatchStatus.VALIDATING], "in_progress", 1)
    assert await lane_ready(store, "m-valid") == 0
    assert await store.claim(["m-valid"], 3, "t1", NOW + LEASE, NOW) == []
    await store.resume(batch.id)
    assert await lane_ready(store, "m-valid") == 1


async def test_batches_ahead_are_the_orgs_higher_ranks_with_work_ready(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    waiting = await make_batch(store, org, 5, model="m-ahead")
    top = await make_batch(store, org, 5, model="m-ahead", priority=7)
    await store.set_priority(top.id, 7)
    mid = await make_batch(store, org, 5, model="m-ahead")
    await store.set_priority(mid.id, 2)
    # Not ahead: another org's, another model's, a later one at the same priority, a paused
    # one.
    await make_batch(store, other, 5, model="m-ahead", priority=9)
    await make_batch(store, org, 5, model="m-other", priority=9)
    held = await make_batch(store, org, 5, model="m-ahead")
    await store.set_priority(held.id, 8)
    await store.pause(held.id, int(NOW))

    later = await make_batch(store, org, 5, model="m-ahead", expires_at=int(NOW) + 90_000)
    ahead = await store.batches_ahead([waiting.id, top.id, later.id])
    assert set(ahead) == {waiting.id, later.id}
    found = ahead[waiting.id]
    assert (found.batches, found.top_priority) == (2, 7)
    # At the same priority, the earlier deadline goes first.
    assert ahead[later.id].batches == 3
    assert found.done_by is None  # no estimate stored for them yet

    # A batch with a line out is moving: nothing is ahead of it.
    # (Each org's lane gets its part of a claim; this org's goes to its top batch.)
    claims = await store.claim(["m-ahead"], 2, "t1", NOW + LEASE, NOW)
    assert top.id in {c.batch.id for c in claims}
    assert mid.id not in {c.batch.id for c in claims}
    assert set(await store.batches_ahead([top.id, mid.id])) == {mid.id}
