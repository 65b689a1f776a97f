"""The notification outbox on SQLite and PostgreSQL: messages written with the terminal status,
one sender per attempt across processes, leases that hand an interrupted attempt on."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.clock import SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.fetch import FetchPolicy
from backfill.adapters.notify.webhooks import SignedWebhooks
from backfill.domain import ids
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.notifications import (
    Attempt,
    Channel,
    DeliveryState,
    Endpoint,
    ReplacedSecret,
    RetrySchedule,
)
from backfill.domain.records import Org
from backfill.metrics import Metrics
from backfill.runner.notify import Notifier, NotifyConfig
from tests.contract.test_store import make_batch, make_org
from tests.receivers import webhook_receiver
from tests.support import stores_on_one_database

NOW = 1_000_000.0
HOOK = "https://hooks.example.com/batch"


@pytest.fixture(params=["postgresql", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[SqlStore]]:
    """Two stores over one database, as two worker processes hold them."""
    async with stores_on_one_database(request.param, tmp_path, 2) as made:
        yield made


async def ended(store: SqlStore, org: Org, status: BatchStatus, **fields: object) -> str:
    """A batch moved to ``status`` (terminal) the way a cancel or expiry moves it."""
    batch = await make_batch(store, org, 2, **fields)  # type: ignore[arg-type]
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], status, int(NOW))
    return batch.id


async def test_the_terminal_transition_writes_the_messages(stores: list[SqlStore]) -> None:
    store = stores[0]
    org = await make_org(store)
    await store.add_webhook_endpoint(
        org.id, Endpoint("we_1", "https://a.example.com", frozenset({"batch.cancelled"})), 1, 16
    )
    await store.add_webhook_endpoint(
        org.id, Endpoint("we_2", "https://b.example.com", frozenset({"batch.expired"})), 1, 16
    )
    await store.set_notify_email(org.id, "ops@example.com")
    batch_id = await ended(store, org, BatchStatus.CANCELLED, webhook_url=HOOK, metadata={"k": "v"})
    sent = await store.batch_notifications(org.id, batch_id)
    by_channel = {n.channel: n for n in sent}
    assert sorted(by_channel) == sorted([Channel.WEBHOOK, Channel.ENDPOINT, Channel.EMAIL])
    assert by_channel[Channel.WEBHOOK].payload == {
        "batch_id": batch_id,
        "status": "cancelled",
        "metadata": {"k": "v"},
    }
    assert by_channel[Channel.WEBHOOK].target == HOOK
    endpoint = by_channel[Channel.ENDPOINT]
    assert (endpoint.endpoint_id, endpoint.event) == ("we_1", "batch.cancelled")
    assert endpoint.payload["data"] == {"id": batch_id}
    assert by_channel[Channel.EMAIL].payload["total"] == 2
    assert all(n.state == DeliveryState.PENDING and n.attempts == 0 for n in sent)
    # Another org sees none of them.
    other = await make_org(store)
    assert await store.batch_notifications(other.id, batch_id) == []


async def test_other_transitions_write_nothing(stores: list[SqlStore]) -> None:
    store = stores[0]
    org = await make_org(store)
    batch = await make_batch(store, org, 2, webhook_url=HOOK)
    assert await store.transition(
        batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, int(NOW)
    )
    assert await store.batch_notifications(org.id, batch.id) == []
    # A batch without a webhook, endpoints or email sends nothing when it ends.
    quiet = await ended(store, org, BatchStatus.EXPIRED)
    assert await store.batch_notifications(org.id, quiet) == []


async def test_a_failed_start_writes_the_failed_message(stores: list[SqlStore]) -> None:
    store = stores[0]
    org = await make_org(store)
    batch = await make_batch(store, org, 2, status=BatchStatus.VALIDATING, webhook_url=HOOK)
    assert await store.fail_batch(batch.id, BatchStatus.VALIDATING, int(NOW), [])
    [message] = await store.batch_notifications(org.id, batch.id)
    assert message.payload["status"] == "failed"
    assert message.event == "batch.failed"


async def test_each_message_is_leased_to_one_sender(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    for _ in range(30):
        await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=HOOK)

    async def drain(store: SqlStore, token: str) -> list[str]:
        got: list[str] = []
        while batch := await store.claim_notifications(NOW, token, NOW + 60, 4):
            got += [m.id for m in batch]
            assert all(m.attempts == 1 for m in batch)
        return got

    first, second = await asyncio.gather(drain(stores[0], "a"), drain(stores[1], "b"))
    assert len(first) + len(second) == 30
    assert not set(first) & set(second)


async def test_an_interrupted_attempt_is_handed_on_with_its_id(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=HOOK)
    [held] = await stores[0].claim_notifications(NOW, "dead", NOW + 30, 10)
    assert await stores[1].claim_notifications(NOW + 29, "live", NOW + 60, 10) == []
    [again] = await stores[1].claim_notifications(NOW + 31, "live", NOW + 61, 10)
    assert (again.id, again.attempts) == (held.id, 2)
    # The sender whose lease ran out records nothing over the one that took it on.
    late = Attempt(delivered=True, at=int(NOW) + 40, status_code=200)
    assert not await stores[0].finish_attempt(held.id, "dead", late)
    failed = Attempt(
        delivered=False, at=int(NOW) + 40, status_code=500, error="500", next_at=NOW + 90
    )
    assert await stores[1].finish_attempt(again.id, "live", failed)
    [row] = await stores[1].batch_notifications(org.id, again.batch_id)
    assert (row.state, row.last_status_code, row.next_at) == (DeliveryState.PENDING, 500, NOW + 90)
    assert await stores[1].claim_notifications(NOW + 89, "x", NOW + 120, 10) == []
    given_up = Attempt(delivered=False, at=int(NOW) + 95, status_code=500, error="500")
    [third] = await stores[0].claim_notifications(NOW + 90, "y", NOW + 120, 10)
    assert await stores[0].finish_attempt(third.id, "y", given_up)
    [row] = await stores[1].batch_notifications(org.id, again.batch_id)
    assert row.state == DeliveryState.GIVEN_UP
    assert await stores[0].claim_notifications(NOW + 1000, "z", NOW + 1100, 10) == []


async def test_an_org_holds_a_bounded_number_of_endpoints(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    events = frozenset({"batch.completed"})
    made = await asyncio.gather(
        *(
            stores[i % 2].add_webhook_endpoint(
                org.id, Endpoint(ids.webhook_endpoint_id(), HOOK, events), 1, 3
            )
            for i in range(6)
        )
    )
    assert sum(made) == 3
    assert len(await stores[0].webhook_endpoints(org.id)) == 3


async def test_two_senders_never_send_one_attempt_twice(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    keyring = Keyring(os.urandom(32))
    policy = FetchPolicy(max_bytes=1024, timeout_s=5, allow_http=True, allow_private=True)
    config = NotifyConfig(
        webhooks=RetrySchedule(3, 0.05),
        emails=RetrySchedule(3, 0.05),
        attempt_timeout_s=10,
        interval_s=0.01,
        max_in_flight=8,
    )
    with webhook_receiver() as receiver:
        for _ in range(40):
            await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=receiver.url)
        senders = [
            Notifier(store, SignedWebhooks(policy), None, keyring, SystemClock(), config, Metrics())
            for store in stores
        ]

        async def run(sender: Notifier) -> None:
            deadline = time.monotonic() + 30
            while len(receiver.received) < 40 and time.monotonic() < deadline:
                await sender.step()
                await asyncio.sleep(0.01)

        await asyncio.gather(*(run(s) for s in senders))
        await asyncio.sleep(0.2)
        for sender in senders:
            await sender.stop()
    seen = Counter(r.webhook_id for r in receiver.received)
    assert len(seen) == 40
    assert set(seen.values()) == {1}
    secret = (await stores[0].webhook_secrets(org.id)).current
    assert secret is not None


async def test_rotations_keep_the_two_last_replaced_secrets(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    first = await stores[0].set_webhook_secret(org.id, b"s1", 10, rotate=False)
    assert (first.current, first.replaced) == (b"s1", ())
    await stores[1].set_webhook_secret(org.id, b"s2", 20, rotate=True)
    await stores[0].set_webhook_secret(org.id, b"s3", 30, rotate=True)
    stored = await stores[1].webhook_secrets(org.id)
    assert stored.current == b"s3"
    assert stored.replaced == (ReplacedSecret(b"s2", 30), ReplacedSecret(b"s1", 20))
    last = await stores[0].set_webhook_secret(org.id, b"s4", 40, rotate=True)
    assert last.replaced == (ReplacedSecret(b"s3", 40), ReplacedSecret(b"s2", 30))


async def test_concurrent_rotations_lose_no_secret_they_hand_out(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    await stores[0].set_webhook_secret(org.id, b"s0", 10, rotate=False)
    answers = await asyncio.gather(
        stores[0].set_webhook_secret(org.id, b"a", 20, rotate=True),
        stores[1].set_webhook_secret(org.id, b"b", 20, rotate=True),
    )
    stored = await stores[0].webhook_secrets(org.id)
    # One after the other: the later one's current, the earlier one's just behind it.
    assert stored.current is not None
    held = [stored.current, *(r.sealed for r in stored.replaced)]
    assert sorted(held) == [b"a", b"b", b"s0"]
    assert {a.current for a in answers} == {b"a", b"b"}


async def test_settled_messages_are_pruned_by_age(stores: list[SqlStore]) -> None:
    org = await make_org(stores[0])
    settled = await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=HOOK)
    pending = await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=HOOK)
    claimed = {m.batch_id: m for m in await stores[0].claim_notifications(NOW, "t", NOW + 30, 9)}
    assert await stores[0].finish_attempt(
        claimed[settled].id, "t", Attempt(delivered=True, at=int(NOW), status_code=200)
    )
    assert await stores[0].prune_notifications(int(NOW)) == 0  # not older than the cut
    assert await stores[0].prune_notifications(int(NOW) + 1) == 1
    assert await stores[0].batch_notifications(org.id, settled) == []
    # A message still being delivered stays, however old.
    assert len(await stores[0].batch_notifications(org.id, pending)) == 1


async def test_a_message_given_back_is_due_at_once_and_not_counted(
    stores: list[SqlStore],
) -> None:
    org = await make_org(stores[0])
    await ended(stores[0], org, BatchStatus.CANCELLED, webhook_url=HOOK)
    [held] = await stores[0].claim_notifications(NOW, "stopping", NOW + 30, 10)
    assert not await stores[1].give_back(held.id, "other", NOW + 1)
    assert await stores[0].give_back(held.id, "stopping", NOW + 1)
    [again] = await stores[1].claim_notifications(NOW + 1, "next", NOW + 31, 10)
    assert (again.id, again.attempts) == (held.id, 1)
