"""Whose ``X-Forwarded-For`` a real ``backfill up`` believes: by default nobody's, loopback's
neither, so a client behind a same-host proxy that passes its header on cannot choose the
address the authentication brake counts (the 2026-12-05 review, L4); with the proxy listed in
``forwarded_allow_ips``, the client address it forwards is the one braked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    start_server_process,
    start_simulator_process,
)

pytestmark = pytest.mark.e2e

TOKEN = "forwarded-admin-token-0123456789abcdef"
LIMIT = 5
SETTINGS = f'admin_token = "{TOKEN}"\nauth_failure_limit = {LIMIT}\n'


@pytest.fixture(scope="module")
def simulator() -> Iterator[SimulatorProcess]:
    process = start_simulator_process()
    try:
        yield process
    finally:
        process.stop()


def server(tmp_path: Path, simulator: SimulatorProcess, extra: str = "") -> ServerProcess:
    return start_server_process(tmp_path, simulator.base_url, extra=SETTINGS + extra)


def admin(client: httpx.Client, token: str, forwarded_for: str) -> int:
    answer = client.get(
        "/admin/v1/orgs",
        headers={"Authorization": f"Bearer {token}", "X-Forwarded-For": forwarded_for},
    )
    return answer.status_code


def test_by_default_a_forwarded_address_is_not_believed(
    tmp_path: Path, simulator: SimulatorProcess
) -> None:
    running = server(tmp_path, simulator)
    try:
        with running.client() as client:
            # Wrong tokens "from" another address each time: all are the loopback client's.
            assert [admin(client, "wrong", f"198.51.100.{n}") for n in range(LIMIT)] == [
                401
            ] * LIMIT
            # The brake holds whatever address the client then claims to be.
            assert [admin(client, TOKEN, f"203.0.113.{n}") for n in range(3)] == [429] * 3
    finally:
        running.stop()


def test_a_listed_proxys_forwarded_address_is_the_one_braked(
    tmp_path: Path, simulator: SimulatorProcess
) -> None:
    running = server(tmp_path, simulator, 'forwarded_allow_ips = ["127.0.0.1", "::1"]\n')
    try:
        with running.client() as client:
            assert [admin(client, "wrong", "10.9.9.9") for _ in range(LIMIT)] == [401] * LIMIT
            assert admin(client, TOKEN, "10.9.9.9") == 429
            assert admin(client, TOKEN, "10.9.9.8") == 200
    finally:
        running.stop()
