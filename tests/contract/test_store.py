"""One contract for every ``Store`` backend: tenants, batches and the leased work queue.

Add a backend with one line in ``STORE_URLS`` (a function from the test's tmp dir to a URL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backfill.adapters.db.store import SqlStore
from backfill.domain.chunks import Chunker
from backfill.domain.files import FilePurpose, FileRecord, FileStatus
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.lines import LineRef
from backfill.domain.records import (
    Admission,
    ApiKey,
    BatchRecord,
    ClaimedItem,
    ItemResult,
    Org,
    StoredResult,
)
from backfill.errors import Conflict
from backfill.services.tenants import hash_secret

STORE_URLS: dict[str, Callable[[Path], str]] = {
    "sqlite": lambda tmp: f"sqlite+aiosqlite:///{tmp / 'store.db'}",
    "postgresql": lambda _: "",  # a fresh database per test, made by the fixture
}

NOW = 1_000_000.0
LEASE = 30.0


def _id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(8)}"


async def make_org(store: SqlStore, name: str | None = None) -> Org:
    org = Org(id=_id("org_"), name=name or _id("org-"), created_at=int(NOW))
    await store.create_org(org)
    return org


def file_record(org: Org, purpose: FilePurpose = FilePurpose.BATCH, **changes: Any) -> FileRecord:
    file_id = _id("file-")
    record = FileRecord(
        id=file_id,
        org_id=org.id,
        purpose=purpose,
        filename=f"{file_id}.jsonl",
        bytes=10,
        created_at=int(NOW),
        expires_at=int(NOW) + 3600,
        status=FileStatus.PROCESSED,
    )
    return dataclasses.replace(record, **changes)


async def make_batch(
    store: SqlStore,
    org: Org,
    items: int = 5,
    *,
    status: BatchStatus = BatchStatus.IN_PROGRESS,
    idempotency_key: str | None = None,
    model: str | None = None,
    admission: Admission | None = None,
    line_bytes: int = 100,
    **fields: Any,
) -> BatchRecord:
    """A batch of its own model (so a claim for that model takes only its lines), whose lines
    lie ``line_bytes`` apart; ``fields`` set more of its record (prices, for one)."""
    source = file_record(org)
    await store.create_file(source)
    batch = BatchRecord(
        id=_id("batch_"),
        org_id=org.id,
        endpoint="/v1/chat/completions",
        model=model or _id("m-"),
        model_config_id="m-v1",
        input_file_id=source.id,
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=int(NOW),
        expires_at=int(NOW) + 86400,
        total=items,
        idempotency_key=idempotency_key,
    )
    batch = dataclasses.replace(batch, **fields)
    await store.create_batch(batch, admission or ADMIT_ALL)
    lines = [LineRef(i, i * line_bytes, line_bytes, f"req-{i}") for i in range(items)]
    chunker = Chunker()
    await store.add_items(batch.id, [*chunker.feed(lines), *chunker.close()])
    if status != BatchStatus.VALIDATING:
        # Through in_progress, as a started batch goes: its lane opens then.
        assert await store.transition(batch.id, [BatchStatus.VALIDATING], "in_progress", 1)
        if status != BatchStatus.IN_PROGRESS:
            assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], status, 2)
    return dataclasses.replace(batch, status=status)


async def take(
    store: SqlStore, batch: BatchRecord, limit: int, token: str, lease_until: float, now: float
) -> list[ClaimedItem]:
    """Claim up to ``limit`` lines for an engine serving only ``batch``'s model (a claim takes
    one chunk per lane, so as many claims as that needs)."""
    items: list[ClaimedItem] = []
    while len(items) < limit:
        claims = await store.claim([batch.model], limit - len(items), token, lease_until, now)
        if not claims:
            break
        items += [item for claim in claims for item in claim.items]
    return items


ADMIT_ALL = Admission(
    reserve=0,
    require_positive_balance=False,
    max_unfinished=1000,
    max_retained_input_bytes=1 << 40,
    throughput_tokens_per_s=None,
)


def ok(
    item: ClaimedItem, token: str, payload: bytes = b"sealed", tin: int = 3, tout: int = 5
) -> ItemResult:
    return ItemResult(item.batch_id, item.idx, token, True, payload, tin, tout)


def bad(item: ClaimedItem, token: str) -> ItemResult:
    return ItemResult(item.batch_id, item.idx, token, False, b"error-payload")


async def all_results(store: SqlStore, batch_id: str) -> list[StoredResult]:
    return [r async for page in store.iter_results(batch_id) for r in page]


async def counts(store: SqlStore, batch: BatchRecord) -> tuple[int, int, int, int]:
    got = await store.get_batch(None, batch.id)
    assert got is not None
    return got.completed, got.failed, got.input_tokens, got.output_tokens


# ---- tenants ----------------------------------------------------------------------------


async def test_orgs_are_found_by_name_and_counted(store: SqlStore) -> None:
    assert await store.count_orgs() == 0
    org = await make_org(store, "acme")
    assert await store.org_by_name("acme") == org
    assert await store.org_by_name("nobody") is None
    await make_org(store, "globex")
    assert await store.count_orgs() == 2


async def test_org_names_are_unique(store: SqlStore) -> None:
    await make_org(store, "acme")
    with pytest.raises(Conflict):
        await make_org(store, "acme")
    assert await store.count_orgs() == 1


async def test_api_keys_are_found_by_hash(store: SqlStore) -> None:
    org = await make_org(store)
    key = ApiKey(_id("key_"), org.id, "bf-abcdef", frozenset({"requests:read"}))
    await store.create_api_key(key, hash_secret("bf-secret"))
    found = await store.api_key_by_hash(hash_secret("bf-secret"))
    assert found == key
    assert await store.api_key_by_hash(hash_secret("bf-other")) is None

    both = ApiKey(_id("key_"), org.id, "bf-ghijkl", frozenset({"requests:read", "inference:write"}))
    await store.create_api_key(both, hash_secret("bf-second"))
    found = await store.api_key_by_hash(hash_secret("bf-second"))
    assert found is not None
    assert found.scopes == frozenset({"requests:read", "inference:write"})


# ---- files ------------------------------------------------------------------------------


async def test_files_are_scoped_to_their_org(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    record = file_record(org)
    await store.create_file(record)
    assert await store.get_file(org.id, record.id) == record
    assert await store.get_file(other.id, record.id) is None


async def test_list_files_pages_newest_first(store: SqlStore) -> None:
    org = await make_org(store)
    made = []
    for _ in range(5):
        record = file_record(org)
        await store.create_file(record)
        made.append(record.id)
    first = await store.list_files(org.id, None, None, 2, ascending=False)
    assert [f.id for f in first.items] == made[::-1][:2]
    assert first.has_more is True
    rest = await store.list_files(org.id, None, first.items[-1].id, 10, ascending=False)
    assert [f.id for f in rest.items] == made[::-1][2:]
    assert rest.has_more is False
    asc = await store.list_files(org.id, None, None, 10, ascending=True)
    assert [f.id for f in asc.items] == made
    await store.mark_file_deleted(made[0])
    listed = await store.list_files(org.id, None, None, 10, ascending=True)
    assert [f.id for f in listed.items] == made[1:]


async def test_unfinished_batch_for_file(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org)
    assert await store.unfinished_batch_for_file(batch.input_file_id) == batch.id
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, 1)
    assert await store.unfinished_batch_for_file(batch.input_file_id) == batch.id
    assert await store.transition(batch.id, [BatchStatus.CANCELLING], BatchStatus.CANCELLED, 2)
    assert await store.unfinished_batch_for_file(batch.input_file_id) is None


# ---- batches ----------------------------------------------------------------------------


async def test_batches_are_scoped_to_their_org(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    batch = await make_batch(store, org, 1)
    assert (await store.get_batch(org.id, batch.id)) is not None
    assert (await store.get_batch(None, batch.id)) is not None
    assert await store.get_batch(other.id, batch.id) is None
    assert (await store.list_batches(other.id, None, 10)).items == []


async def test_idempotency_key_is_unique_per_org(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    first = await make_batch(store, org, 1, idempotency_key="run-1")
    with pytest.raises(Conflict):
        await make_batch(store, org, 1, idempotency_key="run-1")
    found = await store.batch_by_idempotency_key(org.id, "run-1")
    assert found is not None
    assert found.id == first.id
    # Scoped to the org, and batches without a key never collide.
    await make_batch(store, other, 1, idempotency_key="run-1")
    await make_batch(store, org, 1)
    await make_batch(store, org, 1)
    assert await store.batch_by_idempotency_key(org.id, "run-2") is None


async def test_transition_is_conditional_and_sets_the_timestamp(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 1, status=BatchStatus.VALIDATING)
    assert not await store.transition(batch.id, [BatchStatus.IN_PROGRESS], "finalizing", 5)
    assert await store.transition(batch.id, [BatchStatus.VALIDATING], "in_progress", 7)
    got = await store.get_batch(org.id, batch.id)
    assert got is not None
    assert (got.status, got.in_progress_at) == ("in_progress", 7)
    assert not await store.transition(batch.id, [BatchStatus.VALIDATING], "in_progress", 9)
    assert [b.id for b in await store.batches_in([BatchStatus.IN_PROGRESS])] == [batch.id]


async def test_list_batches_newest_first(store: SqlStore) -> None:
    org = await make_org(store)
    made = [(await make_batch(store, org, 1)).id for _ in range(3)]
    page = await store.list_batches(org.id, None, 2)
    assert [b.id for b in page.items] == made[::-1][:2]
    assert page.has_more is True
    rest = await store.list_batches(org.id, page.items[-1].id, 2)
    assert [b.id for b in rest.items] == made[:1]
    assert rest.has_more is False


# ---- the work queue ---------------------------------------------------------------------


async def test_claim_returns_items_in_index_order_once(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 5)
    first = await take(store, batch, 3, "token-a", NOW + LEASE, NOW)
    assert [c.idx for c in first] == [0, 1, 2]
    assert first[0] == ClaimedItem(batch.id, 0, 0, 100, "req-0")
    second = await take(store, batch, 10, "token-b", NOW + LEASE, NOW)
    assert [c.idx for c in second] == [3, 4]
    assert await take(store, batch, 10, "token-c", NOW + LEASE, NOW) == []
    assert await store.live_leases(batch.id, NOW) == 5


async def test_claim_is_per_model(store: SqlStore) -> None:
    org = await make_org(store)
    one, two = await make_batch(store, org, 2), await make_batch(store, org, 2)
    claimed = await take(store, one, 10, "token-a", NOW + LEASE, NOW)
    assert {c.batch_id for c in claimed} == {one.id}
    assert len(await take(store, two, 10, "token-a", NOW + LEASE, NOW)) == 2


async def test_concurrent_claims_never_share_an_item(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 40)
    tokens = [f"token-{n}" for n in range(12)]
    claims: list[list[ClaimedItem]] = [[] for _ in tokens]
    # Concurrent claimers skip a chunk another one holds, so it takes a few rounds.
    while sum(map(len, claims)) < 40:
        rounds = await asyncio.gather(
            *(take(store, batch, 4, token, NOW + LEASE, NOW) for token in tokens)
        )
        assert any(rounds)
        for mine, got in zip(claims, rounds, strict=True):
            mine += got
    owned = [c.idx for claimed in claims for c in claimed]
    assert sorted(owned) == list(range(40))
    # Every claimer can write what it got, and only that.
    for token, claimed in zip(tokens, claims, strict=True):
        if claimed:
            assert await store.write_results([ok(c, token) for c in claimed]) == [True] * len(
                claimed
            )
    assert (await counts(store, batch))[:2] == (40, 0)


async def test_an_expired_lease_is_claimed_by_another_token(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    assert len(await take(store, batch, 2, "token-a", NOW + LEASE, NOW)) == 2
    # Still leased: nobody else gets it.
    assert await take(store, batch, 2, "token-b", NOW + 2 * LEASE, NOW + LEASE - 1) == []
    later = NOW + LEASE + 1
    # Expired leases go back to the queue by the sweep, not by the claim.
    assert await take(store, batch, 2, "token-b", later + LEASE, later) == []
    assert await store.requeue_expired(later) == 2
    taken = await take(store, batch, 2, "token-b", later + LEASE, later)
    assert [c.idx for c in taken] == [0, 1]
    assert await store.live_leases(batch.id, later) == 2


async def test_late_writer_is_fenced_after_takeover(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 1)
    [item] = await take(store, batch, 1, "token-a", NOW + LEASE, NOW)
    later = NOW + LEASE + 1
    await store.requeue_expired(later)
    [again] = await take(store, batch, 1, "token-b", later + LEASE, later)
    assert again.idx == item.idx

    assert await store.write_results([ok(item, "token-a", b"from-a")]) == [False]
    assert await counts(store, batch) == (0, 0, 0, 0)
    assert await store.write_results([ok(again, "token-b", b"from-b")]) == [True]
    assert await counts(store, batch) == (1, 0, 3, 5)
    # The first writer, waking up again, still cannot overwrite.
    assert await store.write_results([ok(item, "token-a", b"from-a")]) == [False]
    [stored] = await all_results(store, batch.id)
    assert (stored.ok, stored.payload) == (True, b"from-b")
    assert await counts(store, batch) == (1, 0, 3, 5)


async def test_write_results_counts_each_item_exactly_once(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 4)
    items = await take(store, batch, 4, "token-a", NOW + LEASE, NOW)
    flags = await store.write_results(
        [ok(items[0], "token-a"), bad(items[1], "token-a"), ok(items[0], "token-a")]
    )
    assert flags == [True, True, False]
    assert await counts(store, batch) == (1, 1, 3, 5)
    # A retried write of the same results is rejected and changes nothing.
    assert await store.write_results([ok(items[0], "token-a"), bad(items[1], "token-a")]) == [
        False,
        False,
    ]
    assert await counts(store, batch) == (1, 1, 3, 5)
    # A wrong token for a held item is rejected too.
    assert await store.write_results([ok(items[2], "token-z")]) == [False]
    assert await store.write_results([ok(items[2], "token-a", tin=10, tout=20)]) == [True]
    assert await counts(store, batch) == (2, 1, 13, 25)
    # Done items are never claimed again.
    later = NOW + LEASE + 1
    await store.requeue_expired(later)
    assert [c.idx for c in await take(store, batch, 10, "token-b", later + LEASE, later)] == [3]


async def test_write_results_across_batches(store: SqlStore) -> None:
    org = await make_org(store)
    one, two = await make_batch(store, org, 1), await make_batch(store, org, 1)
    [a] = await take(store, one, 1, "token-a", NOW + LEASE, NOW)
    [b] = await take(store, two, 1, "token-a", NOW + LEASE, NOW)
    assert await store.write_results([ok(a, "token-a"), bad(b, "token-a")]) == [True, True]
    assert await counts(store, one) == (1, 0, 3, 5)
    assert await counts(store, two) == (0, 1, 0, 0)


async def test_close_unfinished_fences_leased_items(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 4)
    items = await take(store, batch, 3, "token-a", NOW + LEASE, NOW)
    assert await store.write_results([ok(items[0], "token-a")]) == [True]
    # Items 1 and 2 are leased (in flight), item 3 is queued.
    assert await store.close_unfinished(batch.id, "batch_cancelled") == 3
    assert await store.live_leases(batch.id, NOW) == 0
    assert await store.write_results([ok(items[1], "token-a")]) == [False]
    assert await take(store, batch, 10, "token-b", NOW * 2, NOW * 2) == []
    assert await counts(store, batch) == (1, 3, 3, 5)
    results = await all_results(store, batch.id)
    assert [(r.idx, r.ok, r.error_code) for r in results] == [
        (0, True, None),
        (1, False, "batch_cancelled"),
        (2, False, "batch_cancelled"),
        (3, False, "batch_cancelled"),
    ]
    # Closing again closes nothing and counts nothing.
    assert await store.close_unfinished(batch.id, "batch_expired") == 0
    assert await counts(store, batch) == (1, 3, 3, 5)


async def test_release_puts_an_item_back(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    [first, _] = await take(store, batch, 2, "token-a", NOW + LEASE, NOW)
    await store.release(batch.id, first.idx, "token-wrong")
    assert await take(store, batch, 2, "token-b", NOW + LEASE, NOW) == []
    await store.release(batch.id, first.idx, "token-a")
    assert await store.live_leases(batch.id, NOW) == 1
    [again] = await take(store, batch, 2, "token-b", NOW + LEASE, NOW)
    assert again.idx == first.idx
    assert await store.write_results([ok(first, "token-a")]) == [False]
    assert await store.write_results([ok(again, "token-b")]) == [True]


async def test_renewed_leases_are_not_taken_over(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    items = await take(store, batch, 2, "token-a", NOW + LEASE, NOW)
    await store.renew_leases("token-a", NOW + 10 * LEASE, {batch.id: [i.idx for i in items]})
    later = NOW + 2 * LEASE
    assert await store.requeue_expired(later) == 0
    assert await take(store, batch, 2, "token-b", later + LEASE, later) == []
    assert await store.live_leases(batch.id, later) == 2
    assert await store.write_results([ok(i, "token-a") for i in items]) == [True, True]


async def test_release_all_leases_requeues_everything(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 3)
    held = await take(store, batch, 3, "token-a", NOW + LEASE, NOW)
    await store.release_all_leases()
    assert await store.live_leases(batch.id, NOW) == 0
    assert [c.idx for c in await take(store, batch, 3, "token-b", NOW + LEASE, NOW)] == [
        0,
        1,
        2,
    ]
    assert await store.write_results([ok(held[0], "token-a")]) == [False]


async def test_iter_results_pages_in_index_order(store: SqlStore) -> None:
    org = await make_org(store)
    total = 2345
    batch = await make_batch(store, org, total)
    claimed = await take(store, batch, total, "token-a", NOW + LEASE, NOW)
    assert len(claimed) == total
    flags = await store.write_results(
        [
            ok(c, "token-a", payload=f"payload-{c.idx}".encode())
            if c.idx % 3
            else bad(c, "token-a")
            for c in claimed
        ]
    )
    assert all(flags)
    pages = [page async for page in store.iter_results(batch.id)]
    assert len(pages) > 1
    assert sum(len(p) for p in pages) == total
    results = [r for page in pages for r in page]
    assert [r.idx for r in results] == list(range(total))
    assert [r.custom_id for r in results] == [f"req-{i}" for i in range(total)]
    assert results[1].payload == b"payload-1"
    assert results[0] == StoredResult(0, "req-0", False, b"error-payload", None)
    assert sum(r.ok for r in results) == total - len(range(0, total, 3))


async def test_publish_is_conditional_on_the_expected_status(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 1, status=BatchStatus.FINALIZING)
    assert (await store.take_finalize(batch.id, ["finalizing"], "fin-a", NOW + LEASE, NOW)).taken
    out = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    err = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    assert await store.publish(batch.id, "finalizing", "completed", 42, out, err, token="fin-a")
    got = await store.get_batch(org.id, batch.id)
    assert got is not None
    assert (got.status, got.completed_at) == ("completed", 42)
    assert (got.output_file_id, got.error_file_id) == (out.id, err.id)
    assert await store.get_file(org.id, out.id) == out
    assert await store.get_file(org.id, err.id) == err

    # A second finalizer loses the race and creates nothing.
    out2 = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    err2 = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    assert not await store.publish(
        batch.id, "finalizing", "completed", 43, out2, err2, token="fin-a"
    )
    assert await store.get_file(org.id, out2.id) is None
    assert await store.get_file(org.id, err2.id) is None
    got = await store.get_batch(org.id, batch.id)
    assert got is not None
    assert (got.output_file_id, got.completed_at) == (out.id, 42)


async def test_publish_is_atomic(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 1, status=BatchStatus.FINALIZING)
    existing = file_record(org, FilePurpose.BATCH_OUTPUT)
    await store.create_file(existing)
    assert (await store.take_finalize(batch.id, ["finalizing"], "fin-a", NOW + LEASE, NOW)).taken
    out = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    # The error file's id collides, so the second insert fails inside the transaction.
    clash = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id, id=existing.id)
    try:
        published = await store.publish(
            batch.id, "finalizing", "completed", 42, out, clash, token="fin-a"
        )
    except Exception:
        published = False
    assert published is False
    got = await store.get_batch(org.id, batch.id)
    assert got is not None
    assert (got.status, got.output_file_id, got.completed_at) == ("finalizing", None, None)
    assert await store.get_file(org.id, out.id) is None
    # The store is usable afterwards and the real publish goes through.
    err = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    assert await store.publish(batch.id, "finalizing", "cancelled", 50, out, err, token="fin-a")
    got = await store.get_batch(org.id, batch.id)
    assert got is not None
    assert (got.status, got.cancelled_at) == ("cancelled", 50)


async def test_a_catalog_id_keeps_its_owner(store: SqlStore) -> None:
    from backfill.domain.catalog import CatalogModel
    from backfill.domain.money import Prices

    org, other = await make_org(store), await make_org(store)
    public = CatalogModel("pub", "pub-v1", 4096, 256, prices=Prices(1, 1, 1))
    private = CatalogModel("dep", "dep-v1", 4096, 256, owner_org_id=org.id, gpu_count=1)
    assert await store.upsert_model(public, 1, replace=True) is None
    assert await store.upsert_model(private, 1, replace=True) is None
    # Another owner: the entry that had the id comes back, and nothing is written.
    for taking in (
        dataclasses.replace(public, owner_org_id=org.id, prices=None, gpu_count=1),
        dataclasses.replace(private, owner_org_id=None, gpu_count=0, prices=Prices(1, 1, 1)),
        dataclasses.replace(private, owner_org_id=other.id),
    ):
        before = await store.upsert_model(taking, 2, replace=True)
        assert before is not None
        assert before.owner_org_id != taking.owner_org_id
    assert {m.id: m for m in await store.list_models()} == {"pub": public, "dep": private}
    # The same owner: replaced.
    cheaper = dataclasses.replace(public, prices=Prices(0, 0, 0))
    assert await store.upsert_model(cheaper, 3, replace=True) == public
    assert cheaper in await store.list_models()


async def test_concurrent_puts_of_a_new_id_make_one_entry(store: SqlStore) -> None:
    """The first inserts; the others find it and update it, none fails on the unique key."""
    from backfill.domain.catalog import CatalogModel
    from backfill.domain.money import Prices

    models = [
        CatalogModel("new", f"new-v{n}", 4096, 256, prices=Prices(n, n, n)) for n in range(40)
    ]
    found = await asyncio.gather(*(store.upsert_model(m, 1, replace=True) for m in models))
    assert found.count(None) == 1
    [stored] = await store.list_models()
    assert stored in models
