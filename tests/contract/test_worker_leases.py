"""The lease rules the worker relies on when a request fails inside it (SPEC §9), on SQLite and
PostgreSQL: a release can carry a backoff, and the heartbeat renews only what it names."""

from __future__ import annotations

from backfill.adapters.db.store import SqlStore
from tests.contract.test_store import LEASE, NOW, make_batch, make_org, ok, take


async def test_heartbeat_renews_only_the_leases_it_names(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 3)
    items = await take(store, batch, 3, "token-a", NOW + LEASE, NOW)
    # Item 1 lost its task: the heartbeat leaves its lease to run out.
    await store.renew_leases("token-a", NOW + 10 * LEASE, {batch.id: [0, 2]})
    later = NOW + 2 * LEASE
    assert await store.live_leases(batch.id, later) == 2
    assert await store.requeue_expired(later) == 1
    [taken] = await take(store, batch, 3, "token-b", later + LEASE, later)
    assert taken.idx == 1
    # Another token's leases are never renewed by this one.
    await store.renew_leases("token-a", NOW + 20 * LEASE, {batch.id: [1]})
    assert await store.write_results([ok(items[1], "token-a")]) == [False]
    assert await store.write_results([ok(taken, "token-b")]) == [True]


async def test_release_with_backoff_is_not_claimed_early_and_holds_nothing(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    [first, second] = await take(store, batch, 2, "token-a", NOW + LEASE, NOW)
    await store.release(batch.id, first.idx, "token-a", NOW + 5)
    # Released is not leased: a cancel does not wait on it.
    assert await store.live_leases(batch.id, NOW) == 1
    assert await take(store, batch, 2, "token-b", NOW + LEASE, NOW + 4) == []
    [again] = await take(store, batch, 2, "token-b", NOW + 6 + LEASE, NOW + 6)
    assert again.idx == first.idx
    assert await store.write_results([ok(first, "token-a"), ok(second, "token-a")]) == [
        False,
        True,
    ]
    assert await store.write_results([ok(again, "token-b")]) == [True]
