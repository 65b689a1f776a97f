"""A server SIGKILLed after a batch ended, or in the middle of delivering its webhook, still
delivers it once it is back, with the same ``webhook-id`` (SPEC §10.5)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.receivers import Answer, webhook_receiver
from tests.support import (
    TERMINAL,
    ServerProcess,
    SimulatorProcess,
    batch_of,
    chat_line,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROWS = [chat_line(f"hook-{i}") for i in range(5)]


def server_with_webhooks(tmp_path: Path, sim: SimulatorProcess, interval_s: float) -> ServerProcess:
    # Short timeouts keep an interrupted attempt's lease (2 x (the longest timeout + 2 s) + 5 s)
    # short.
    extra = f"""
webhook_allow_http = true
webhook_allow_private = true
webhook_timeout_s = 2.0
smtp_timeout_s = 2.0
webhook_retry_base_s = 0.2
notify_interval_s = {interval_s}
"""
    return start_server_process(tmp_path, sim.base_url, extra=extra)


def run_to_the_end(client: httpx.Client, url: str) -> str:
    batch_id = submit(client, ROWS, webhook_url=url)
    deadline = time.monotonic() + 60
    while batch_of(client, batch_id)["status"] not in TERMINAL:
        assert time.monotonic() < deadline, "the batch did not end"
        time.sleep(0.02)
    return batch_id


def delivered(client: httpx.Client, batch_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        [delivery] = client.get(f"/v1/batches/{batch_id}/notifications").json()["data"]
        if delivery["status"] == "delivered":
            return dict(delivery)
        time.sleep(0.1)
    raise AssertionError(f"not delivered: {delivery}")


def test_killed_right_after_the_batch_ended(tmp_path: Path, sim_process: SimulatorProcess) -> None:
    # Senders look for due messages only every 5 s, so the kill lands before the first attempt.
    server = server_with_webhooks(tmp_path, sim_process, interval_s=5.0)
    try:
        with webhook_receiver() as receiver:
            with server.client() as client:
                batch_id = run_to_the_end(client, receiver.url)
            server.kill()
            assert receiver.received == [], "sent before the kill; widen notify_interval_s"
            server.restart()
            with server.client() as client:
                delivery = delivered(client, batch_id)
            [got] = receiver.wait_for(1)
            assert got.webhook_id == delivery["id"]
            assert got.json == {"batch_id": batch_id, "status": "completed", "metadata": None}
            time.sleep(1)
            assert len(receiver.received) == 1
    finally:
        server.stop()


def test_killed_while_the_receiver_is_answering(
    tmp_path: Path, sim_process: SimulatorProcess
) -> None:
    server = server_with_webhooks(tmp_path, sim_process, interval_s=0.05)
    try:
        with webhook_receiver([Answer(200, delay_s=30)]) as receiver:
            with server.client() as client:
                batch_id = run_to_the_end(client, receiver.url)
            receiver.wait_for(1)
            server.kill()
            server.restart()
            with server.client() as client:
                delivery = delivered(client, batch_id)
            first, second = receiver.wait_for(2)
            assert first.webhook_id == second.webhook_id == delivery["id"]
            assert delivery["attempts"] == 2
            time.sleep(1)
            assert len(receiver.received) == 2
    finally:
        server.stop()
