"""API keys are listed and revoked (admin API and CLI), and a revocation holds at once in every
API process that shares the database (SPEC §7.1, §11.1, §11.3)."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from backfill.adapters.clock import ManualClock
from backfill.cli.admin import app as admin_cli
from backfill.cli.common import load, opened
from backfill.container import build
from backfill.errors import Unauthorized
from backfill.settings import Settings
from tests.support import (
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    running_simulator,
    sim_settings,
)

TOKEN = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MASTER_KEY = base64.b64encode(bytes(range(32))).decode()


@asynccontextmanager
async def second_api(settings: Settings, clock: ManualClock) -> AsyncIterator[httpx.AsyncClient]:
    """Another API process's app on the same database, with no key of its own."""
    other = build(settings, role="api", clock=clock)
    await other.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=other.app()), base_url="http://other.test"
    )
    try:
        yield client
    finally:
        await client.aclose()
        await other.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keys_of(client: httpx.AsyncClient, org: str) -> dict[str, dict[str, Any]]:
    listed = await client.get(f"/admin/v1/orgs/{org}/keys", headers=ADMIN)
    assert listed.status_code == 200, listed.text
    return {k["id"]: k for k in listed.json()["data"]}


async def test_revoked_key_is_refused_at_once_by_every_api_process(tmp_path: Path) -> None:
    url = await create_pg_database()
    clock = ManualClock(1_800_000_000)
    # API processes of one deployment share the master key (the database records its check).
    shared: dict[str, Any] = {"database_url": url, "admin_token": TOKEN, "master_key": MASTER_KEY}
    try:
        async with (
            running_simulator() as (sim_url, _),
            in_process_backfill(tmp_path / "a", sim_url, clock=clock, **shared) as a,
            second_api(sim_settings(tmp_path / "b", sim_url, **shared), clock) as b,
        ):
            made = await a.client.post(
                "/admin/v1/keys",
                json={"org": "default", "name": "nightly evals", "scopes": ["requests:read"]},
                headers=ADMIN,
            )
            assert made.status_code == 200, made.text
            secret, key_id = made.json()["key"], made.json()["id"]
            assert secret.startswith(made.json()["prefix"])
            assert (await b.get("/v1/files", headers=bearer(secret))).status_code == 200

            listed = await keys_of(b, "default")
            assert len(listed) == 2
            assert key_id in listed
            mine = listed[key_id]
            assert mine["name"] == "nightly evals"
            assert mine["scopes"] == ["requests:read"]
            assert mine["created_at"] == 1_800_000_000
            assert mine["last_used_at"] == 1_800_000_000
            assert mine["revoked_at"] is None
            assert secret not in str(listed)

            revoked = await a.client.delete(f"/admin/v1/keys/{key_id}", headers=ADMIN)
            assert revoked.status_code == 200, revoked.text
            assert revoked.json()["revoked_at"] == 1_800_000_000

            # The other process never saw the revocation happen, and refuses the key anyway.
            for client in (b, a.client):
                refused = await client.get("/v1/files", headers=bearer(secret))
                assert refused.status_code == 401, refused.text
                error = refused.json()["error"]
                assert error["code"] == "revoked_api_key"
                assert "revoked" in error["message"]
                assert key_id in error["message"]
            # Other keys of the org keep working.
            assert (await b.get("/v1/files", headers=bearer(a.key))).status_code == 200

            clock.advance(5)
            again = await b.delete(f"/admin/v1/keys/{key_id}", headers=ADMIN)
            assert again.json()["revoked_at"] == 1_800_000_000  # the first revocation stands
            unknown = await b.delete("/admin/v1/keys/key_0000", headers=ADMIN)
            assert unknown.status_code == 404
            assert "admin key list" in unknown.json()["error"]["message"]
            assert (await b.delete(f"/admin/v1/keys/{key_id}")).status_code == 401
    finally:
        await drop_pg_database(url)


async def test_last_used_is_written_at_most_once_a_minute(tmp_path: Path) -> None:
    clock = ManualClock(1_800_000_000)
    async with (
        running_simulator() as (sim_url, _),
        in_process_backfill(tmp_path, sim_url, clock=clock, admin_token=TOKEN) as bf,
    ):

        async def last_used() -> int | None:
            (key,) = (await keys_of(bf.client, "default")).values()
            value: int | None = key["last_used_at"]
            return value

        assert (await bf.client.get("/v1/files")).status_code == 200
        assert await last_used() == 1_800_000_000
        clock.advance(59)
        assert (await bf.client.get("/v1/files")).status_code == 200
        assert await last_used() == 1_800_000_000
        clock.advance(1)
        assert (await bf.client.get("/v1/files")).status_code == 200
        assert await last_used() == 1_800_000_060


async def test_key_names_are_checked(tmp_path: Path) -> None:
    async with (
        running_simulator() as (sim_url, _),
        in_process_backfill(tmp_path, sim_url, admin_token=TOKEN) as bf,
    ):
        for name, words in (("evil\u202etxt", "printable"), ("n" * 101, "limit is 100")):
            refused = await bf.client.post(
                "/admin/v1/keys", json={"org": "default", "name": name}, headers=ADMIN
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "name"
            assert words in refused.json()["error"]["message"]
        assert len(await keys_of(bf.client, "default")) == 1
        missing = await bf.client.get("/admin/v1/orgs/nobody/keys", headers=ADMIN)
        assert missing.status_code == 404


def test_cli_lists_and_revokes_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == 0, result.output
        return result.output

    cli("org", "create", "acme")
    secret = cli("key", "create", "--org", "acme", "--name", "laptop [ci]").strip()
    listing = cli("key", "list", "--org", "acme")
    assert "laptop [ci]" in listing
    assert secret[:9] in listing  # the prefix
    assert secret not in listing
    (key_id,) = re.findall(r"key_[0-9a-f]{16}", listing)

    assert f"Revoked {key_id}" in cli("key", "revoke", key_id)
    after = cli("key", "list", "--org", "acme")
    row = next(line for line in after.splitlines() if key_id in line)
    assert row.count("UTC") == 2  # created and revoked; never used

    async def authenticate() -> None:
        async with opened(load(None, data_dir=tmp_path / "data")) as backfill:
            await backfill.services.tenants.authenticate(secret)

    with pytest.raises(Unauthorized) as refused:
        asyncio.run(authenticate())
    assert refused.value.code == "revoked_api_key"

    missing = runner.invoke(admin_cli, ["key", "revoke", "key_nope", "--data", data])
    assert missing.exit_code == 1
    assert "No API key" in missing.output


def test_cli_names_a_bad_master_key_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    monkeypatch.delenv("BACKFILL_MASTER_KEY", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    (data / "master.key").write_text("not a key\n")
    result = CliRunner().invoke(admin_cli, ["org", "create", "acme", "--data", str(data)])
    assert result.exit_code == 1
    assert "master key" in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_cli_names_an_invalid_setting_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    monkeypatch.setenv("BACKFILL_HEADER_TIMEOUT_S", "0")
    result = CliRunner().invoke(admin_cli, ["org", "create", "acme", "--data", str(tmp_path)])
    assert result.exit_code == 2
    assert "header_timeout_s" in result.output
    assert "Traceback" not in result.output
