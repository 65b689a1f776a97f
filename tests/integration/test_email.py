"""Terminal-state emails over SMTP (seed 004), sent to a real SMTP server (aiosmtpd) from the
same outbox as webhooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.test_webhooks import deliveries, settled
from tests.receivers import smtp_server
from tests.support import Sim, chat_line, eventually, in_process_backfill

SECRET_PROMPT = "the launch codes are 0000"
ROWS = [chat_line(f"r{i}", SECRET_PROMPT) for i in range(4)]


def smtp(port: int, **more: Any) -> dict[str, Any]:
    return {
        "smtp_host": "127.0.0.1",
        "smtp_port": port,
        "smtp_security": "none",
        "smtp_from": "batches@backfill.example",
        "email_retry_base_s": 0.05,
        "notify_interval_s": 0.02,
        "public_url": "https://batch.example.com",
        **more,
    }


async def test_an_ended_batch_sends_one_plain_email(tmp_path: Path, sim: Sim) -> None:
    with smtp_server() as server:
        async with in_process_backfill(tmp_path, sim[0], **smtp(server.port)) as bf:
            await bf.backfill.services.notifications.set_email("default", "ops@example.com")
            batch = await bf.run_batch(ROWS)
            [delivery] = await settled(bf, batch["id"])
            [message] = server.wait_for(1)
    assert delivery["channel"] == "email"
    assert delivery["status"] == "delivered"
    assert delivery["target"] == "ops@example.com"
    assert server.inbox.envelopes == [("batches@backfill.example", ["ops@example.com"])]
    assert message["Subject"] == f"Backfill batch {batch['id']} completed"
    text = message.get_content()
    assert f"Batch {batch['id']} is completed." in text
    assert "4 in all, 4 completed, 0 failed" in text
    assert f"https://batch.example.com/v1/batches/{batch['id']}" in text
    # Content-free: nothing of the requests or their answers.
    assert SECRET_PROMPT not in message.as_string()
    assert "r0" not in text


async def test_a_mail_server_down_for_a_while_gets_the_email_later(
    tmp_path: Path, sim: Sim
) -> None:
    with smtp_server(started=False) as server:
        async with in_process_backfill(tmp_path, sim[0], **smtp(server.port)) as bf:
            await bf.backfill.services.notifications.set_email("default", "ops@example.com")
            batch = await bf.run_batch(ROWS)
            # An attempt counts from its start: at 3 the second has failed for sure (the third
            # is leased only after it), so the server comes up after two failures.
            [pending] = await eventually(
                lambda: deliveries(bf, batch["id"]),
                lambda found: len(found) == 1 and found[0]["attempts"] >= 3,
                10,
                what="the third attempt",
                interval_s=0.05,
            )
            assert pending["status"] == "pending"
            assert "could not be reached" in pending["last_error"]
            server.start()
            [delivery] = await settled(bf, batch["id"])
            server.wait_for(1)
    assert delivery["status"] == "delivered"
    assert delivery["attempts"] >= 3
    assert len(server.inbox.messages) == 1


async def test_without_smtp_settings_the_email_waits_with_a_clear_reason(
    tmp_path: Path, sim: Sim
) -> None:
    # Kept pending on its schedule: a worker that has SMTP settings may still send it.
    async with in_process_backfill(tmp_path, sim[0], notify_interval_s=0.02) as bf:
        await bf.backfill.services.notifications.set_email("default", "ops@example.com")
        batch = await bf.run_batch(ROWS)
        # An attempt counts from its claim; its error is stored when it ends.
        [delivery] = await eventually(
            lambda: deliveries(bf, batch["id"]),
            lambda found: (
                len(found) == 1
                and bool(found[0]["attempts"])
                and found[0]["last_error"] is not None
            ),
            10,
            what="an attempt that ended with an error",
            interval_s=0.05,
        )
    assert delivery["status"] == "pending"
    assert "no SMTP settings (smtp_host)" in delivery["last_error"]


async def test_the_address_is_checked(tmp_path: Path, sim: Sim) -> None:
    async with in_process_backfill(tmp_path, sim[0], admin_token="t" * 40) as bf:
        headers = {"Authorization": "Bearer " + "t" * 40}
        for bad in ["ops", "ops@example", "a b@example.com", 5, "x" * 400 + "@example.com"]:
            response = await bf.client.put(
                "/admin/v1/orgs/default/notifications", json={"email": bad}, headers=headers
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "email"
        response = await bf.client.put(
            "/admin/v1/orgs/default/notifications",
            json={"email": "ops@example.com"},
            headers=headers,
        )
        assert response.json() == {"org": "default", "email": "ops@example.com"}
        response = await bf.client.put(
            "/admin/v1/orgs/default/notifications", json={"email": None}, headers=headers
        )
        assert response.json()["email"] is None


async def test_an_address_list_or_a_control_character_is_refused(tmp_path: Path, sim: Sim) -> None:
    # The 2026-12-05 review, finding L3: these were stored, and each send went to every
    # address a header parser found in them.
    async with in_process_backfill(tmp_path, sim[0], admin_token="t" * 40) as bf:
        headers = {"Authorization": "Bearer " + "t" * 40}
        url = "/admin/v1/orgs/default/notifications"
        kept = await bf.client.put(url, json={"email": "ops@acme.example"}, headers=headers)
        assert kept.status_code == 200, kept.text
        cases = {
            "ops@acme.example,postmaster": "is a list",
            "ops@acme.example;postmaster@acme.example": "is a list",
            "<ops@acme.example>, <cfo@acme.example>": "is a list",
            "ops@acme.example\u0000": "control character (U+0000)",
            "ops@acme.example\r\nBcc: all@acme.example": "control character (U+000D)",
            "<ops@acme.example>": "bare address",
            "Ops<ops@acme.example>": "bare address",
        }
        for bad, words in cases.items():
            response = await bf.client.put(url, json={"email": bad}, headers=headers)
            assert response.status_code == 400, (bad, response.text)
            error = response.json()["error"]
            assert (error["param"], error["code"]) == ("email", "invalid_value")
            assert words in error["message"], error["message"]
            assert "ops@example.com" in error["message"]
        stored = await bf.client.get(url, headers=headers)
        assert stored.json()["email"] == "ops@acme.example"


async def test_an_email_goes_to_exactly_one_recipient(tmp_path: Path, sim: Sim) -> None:
    # An address stored before addresses were checked: the envelope still names it alone,
    # never each address a parse of the To header finds in it.
    with smtp_server() as server:
        async with in_process_backfill(tmp_path, sim[0], **smtp(server.port)) as bf:
            org = await bf.backfill.services.tenants.org("default")
            await bf.backfill.store.set_notify_email(org.id, "ops@example.com,postmaster")
            batch = await bf.run_batch(ROWS)
            [delivery] = await settled(bf, batch["id"])
    assert delivery["attempts"] >= 1
    assert len(server.inbox.rcpts) == 1, server.inbox.rcpts
    assert "postmaster" not in server.inbox.rcpts
