"""Batch webhooks and org endpoints (seed 004, SPEC §10.5), delivered to a real receiver and
verified with the ``standardwebhooks`` package."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from backfill.container import build
from backfill.domain.notifications import DeliveryState
from tests.receivers import Answer, webhook_receiver
from tests.support import (
    InProcess,
    Sim,
    backfill_with,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
)

TOKEN = "t" * 40
ROWS = [chat_line(f"r{i}") for i in range(3)]
# Development switches (off by default) let webhooks reach the receiver on 127.0.0.1.
FAST = {
    "webhook_allow_http": True,
    "webhook_allow_private": True,
    "webhook_retry_base_s": 0.05,
    "notify_interval_s": 0.02,
    "admin_token": TOKEN,
}


async def secret(bf: InProcess) -> str:
    return (await bf.backfill.services.notifications.signing_secret("default")).secret


async def run_with_webhook(
    bf: InProcess, url: str, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    uploaded = await bf.upload(jsonl(ROWS))
    created = await bf.create(uploaded.json()["id"], webhook_url=url, metadata=metadata)
    assert created.status_code == 200, created.text
    assert created.json()["webhook_url"] == url
    return await bf.wait(created.json()["id"])


async def deliveries(bf: InProcess, batch_id: str) -> list[dict[str, Any]]:
    response = await bf.client.get(f"/v1/batches/{batch_id}/notifications")
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def settled(bf: InProcess, batch_id: str, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The batch's notifications once none is pending."""
    return await eventually(
        lambda: deliveries(bf, batch_id),
        lambda seen: bool(seen) and all(d["status"] != "pending" for d in seen),
        timeout_s,
        what=f"the notifications of {batch_id} to settle",
        interval_s=0.05,
    )


async def test_the_seed_body_arrives_signed_once(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url, {"description": "nightly eval job"})
            [delivery] = await settled(bf, batch["id"])
            [got] = receiver.received
            assert got.json == {
                "batch_id": batch["id"],
                "status": "completed",
                "metadata": {"description": "nightly eval job"},
            }
            assert got.headers["content-type"] == "application/json"
            assert got.verifies_with(await secret(bf))
            assert delivery["id"] == got.webhook_id
            assert delivery["channel"] == "webhook"
            assert delivery["event"] == "batch.completed"
            assert delivery["status"] == "delivered"
            assert delivery["attempts"] == 1
            assert delivery["last_status_code"] == 200
            assert delivery["delivered_at"] is not None
            await asyncio.sleep(0.3)
            assert len(receiver.received) == 1


async def test_null_metadata_is_sent_as_null(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            [got] = await receiver.wait_for_async(1)
            assert got.json == {"batch_id": batch["id"], "status": "completed", "metadata": None}


async def test_failures_are_retried_with_the_same_id_until_a_2xx(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver([Answer(500), Answer(404)]) as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            [delivery] = await settled(bf, batch["id"])
            key = await secret(bf)
            assert len(receiver.received) == 3
            assert {r.webhook_id for r in receiver.received} == {delivery["id"]}
            assert all(r.verifies_with(key) for r in receiver.received)
            # Backoff: each retry waits longer than the one before.
            gaps = [b.at - a.at for a, b in pairwise(receiver.received)]
            assert gaps[1] > gaps[0]
            assert delivery["status"] == "delivered"
            assert delivery["attempts"] == 3
            assert delivery["last_error"] is None


async def test_three_failures_give_up(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver([Answer(500)] * 10) as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            [delivery] = await settled(bf, batch["id"])
            assert delivery["status"] == "failed"
            assert delivery["attempts"] == 3
            assert delivery["last_status_code"] == 500
            assert "answered 500" in delivery["last_error"]
            assert delivery["next_attempt_at"] is None
            await asyncio.sleep(0.5)
            assert len(receiver.received) == 3


async def test_a_receiver_that_does_not_answer_is_retried(tmp_path: Path, sim: Sim) -> None:
    # A receiver slower than the timeout counts as a failure and gets the next attempt.
    with webhook_receiver([Answer(200, delay_s=3)]) as receiver:
        async with backfill_with(tmp_path, sim, **FAST, webhook_timeout_s=1.0) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            [delivery] = await settled(bf, batch["id"])
            assert delivery["status"] == "delivered"
            assert delivery["attempts"] == 2
            assert len({r.webhook_id for r in receiver.received}) == 1


async def test_the_default_timeout_is_ten_seconds(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver([Answer(200, delay_s=11)]) as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            assert bf.settings.webhooks.timeout_s == 10
            batch = await run_with_webhook(bf, receiver.url)
            [delivery] = await settled(bf, batch["id"], timeout_s=40)
            assert delivery["attempts"] == 2
            assert delivery["status"] == "delivered"
            first, second = receiver.received[:2]
            assert 9.5 < second.at - first.at < 20


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://hooks.example.com/x", "plain http"),
        ("https://127.0.0.1/x", "loopback"),
        ("https://10.0.0.7/x", "private"),
        ("https://169.254.169.254/latest", "link-local"),
        ("https://localhost/x", "not a public name"),
        ("https://printer.local/x", "not a public name"),
        ("https://user:pw@hooks.example.com/x", "user name or password"),
        ("ftp://hooks.example.com/x", "not an https URL"),
        ("not a url", "not an https URL"),
    ],
)
async def test_webhook_urls_must_be_https_on_a_public_host(
    tmp_path: Path, sim: Sim, url: str, reason: str
) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        uploaded = await bf.upload(jsonl(ROWS))
        created = await bf.create(uploaded.json()["id"], webhook_url=url)
        assert created.status_code == 400, created.text
        error = created.json()["error"]
        assert error["param"] == "webhook_url"
        assert reason in error["message"]
        assert created.headers["x-should-retry"] == "false"
        listed = (await bf.client.get("/v1/batches")).json()["data"]
        assert listed == []


async def test_a_public_https_url_is_taken_and_shown(tmp_path: Path, sim: Sim) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        uploaded = await bf.upload(jsonl(ROWS))
        url = "https://hooks.example.com/backfill?team=evals"
        created = await bf.create(uploaded.json()["id"], webhook_url=url)
        assert created.status_code == 200, created.text
        fetched = (await bf.client.get(f"/v1/batches/{created.json()['id']}")).json()
        assert fetched["webhook_url"] == url


async def test_a_cancelled_batch_says_cancelled(tmp_path: Path, sim: Sim) -> None:
    sim[1].config.ttft_ms = 2000
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            uploaded = await bf.upload(jsonl(ROWS))
            created = await bf.create(uploaded.json()["id"], webhook_url=receiver.url)
            batch_id = created.json()["id"]
            await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
            await bf.wait(batch_id)
            [got] = await receiver.wait_for_async(1)
            assert got.json["status"] == "cancelled"


async def admin(bf: InProcess, method: str, path: str, **kw: Any) -> Any:
    response = await bf.client.request(
        method, f"/admin/v1{path}", headers={"Authorization": f"Bearer {TOKEN}"}, **kw
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_org_endpoints_get_openai_events_for_what_they_chose(
    tmp_path: Path, sim: Sim
) -> None:
    with webhook_receiver() as completed, webhook_receiver() as cancelled:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            made = await admin(
                bf,
                "POST",
                "/orgs/default/webhooks",
                json={"url": completed.url, "events": ["batch.completed", "batch.failed"]},
            )
            assert made["events"] == ["batch.completed", "batch.failed"]
            await admin(
                bf,
                "POST",
                "/orgs/default/webhooks",
                json={"url": cancelled.url, "events": ["batch.cancelled"]},
            )
            listed = await admin(bf, "GET", "/orgs/default/webhooks")
            assert len(listed["data"]) == 2
            batch = await bf.run_batch(ROWS)
            [event] = await completed.wait_for_async(1)
            assert event.json["object"] == "event"
            assert event.json["type"] == "batch.completed"
            assert event.json["data"] == {"id": batch["id"]}
            assert event.json["id"].startswith("evt_")
            assert isinstance(event.json["created_at"], int)
            assert event.verifies_with(await secret(bf))
            [delivery] = await settled(bf, batch["id"])
            assert delivery["channel"] == "endpoint"
            assert delivery["endpoint_id"] == made["id"]
            await asyncio.sleep(0.3)
            assert cancelled.received == []
            await admin(bf, "DELETE", f"/orgs/default/webhooks/{made['id']}")
            await bf.run_batch(ROWS)
            await asyncio.sleep(0.5)
            assert len(completed.received) == 1


async def test_endpoint_input_is_checked(tmp_path: Path, sim: Sim) -> None:
    async with in_process_backfill(tmp_path, sim[0], admin_token=TOKEN) as bf:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        bad = [
            ({"url": "http://hooks.example.com", "events": ["batch.completed"]}, "url"),
            ({"url": "https://hooks.example.com", "events": ["batch.finished"]}, "events"),
            ({"url": "https://hooks.example.com", "events": []}, "events"),
            ({"url": "https://hooks.example.com", "events": "batch.completed"}, "events"),
        ]
        for body, param in bad:
            response = await bf.client.post(
                "/admin/v1/orgs/default/webhooks", json=body, headers=headers
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        extra = {"url": "https://hooks.example.com", "events": ["batch.completed"], "x": 1}
        response = await bf.client.post(
            "/admin/v1/orgs/default/webhooks", json=extra, headers=headers
        )
        assert response.status_code in (400, 422), response.text


async def test_a_rotated_secret_signs_beside_the_old_one(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            old = (await admin(bf, "GET", "/orgs/default/webhook_secret"))["secret"]
            assert old.startswith("whsec_")
            rotated = await admin(bf, "POST", "/orgs/default/webhook_secret/rotate")
            new = rotated["secret"]
            assert new != old
            assert rotated["previous_valid_until"] is not None
            await run_with_webhook(bf, receiver.url)
            [got] = await receiver.wait_for_async(1)
            assert got.verifies_with(new)
            assert got.verifies_with(old)
            assert len(got.headers["webhook-signature"].split(" ")) == 2
            assert not got.verifies_with("whsec_" + "A" * 32)


async def test_a_second_rotation_keeps_the_first_secret_signing(tmp_path: Path, sim: Sim) -> None:
    # The 2026-12-05 review, Info "second rotation": a receiver still on the first secret had
    # been promised a day, and lost it at once when a second rotation followed.
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            first = (await admin(bf, "GET", "/orgs/default/webhook_secret"))["secret"]
            once = await admin(bf, "POST", "/orgs/default/webhook_secret/rotate")
            twice = await admin(bf, "POST", "/orgs/default/webhook_secret/rotate")
            assert len({first, once["secret"], twice["secret"]}) == 3
            assert twice["previous_valid_until"] >= once["previous_valid_until"]
            await run_with_webhook(bf, receiver.url)
            [got] = await receiver.wait_for_async(1)
    for secret in (first, once["secret"], twice["secret"]):
        assert got.verifies_with(secret)
    assert len(got.headers["webhook-signature"].split(" ")) == 3


async def test_other_orgs_see_no_deliveries(tmp_path: Path, sim: Sim) -> None:
    with webhook_receiver() as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            tenants = bf.backfill.services.tenants
            await tenants.create_org("other")
            made = await tenants.new_key("other", frozenset({"requests:read"}), None)
            response = await bf.client.get(
                f"/v1/batches/{batch['id']}/notifications",
                headers={"Authorization": f"Bearer {made.secret}"},
            )
            assert response.status_code == 404
            assert response.json()["error"]["param"] == "batch_id"


async def test_a_stopping_worker_gives_its_attempt_back_uncounted(tmp_path: Path, sim: Sim) -> None:
    # The receiver holds the first attempt past the stop's grace: the worker stops, and the
    # attempt it had under way is handed back as not made.
    with webhook_receiver([Answer(200, delay_s=8)]) as receiver:
        async with backfill_with(tmp_path, sim, **FAST) as bf:
            batch = await run_with_webhook(bf, receiver.url)
            await receiver.wait_for_async(1)
            settings = bf.settings
            org_id = (await bf.backfill.services.tenants.org("default")).id
        again = build(settings, engines=[])
        await again.start()
        try:
            [delivery] = await eventually(
                lambda: again.services.notifications.deliveries(org_id, batch["id"]),
                lambda found: [d.state for d in found] == [DeliveryState.DELIVERED],
                10,
                what="the delivery handed back to be made again",
                interval_s=0.05,
            )
        finally:
            await again.stop()
    assert delivery.state == DeliveryState.DELIVERED
    assert delivery.attempts == 1
    first, second = receiver.received
    assert first.webhook_id == second.webhook_id == delivery.id
