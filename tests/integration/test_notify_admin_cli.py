"""``backfill admin webhook`` and ``backfill admin email`` against a real database."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli
from backfill.cli.common import opened
from backfill.settings import Settings

TOKEN = "t" * 40


def test_the_cli_manages_secrets_endpoints_and_email(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == code, result.output
        return result.output.strip()

    cli("org", "create", "acme")
    secret = cli("webhook", "secret", "acme")
    assert secret.startswith("whsec_")
    assert cli("webhook", "secret", "acme") == secret
    rotated = cli("webhook", "secret", "acme", "--rotate")
    assert rotated.startswith("whsec_")
    assert rotated != secret
    assert cli("webhook", "secret", "acme") == rotated

    added = json.loads(
        cli(
            "webhook",
            "add",
            "acme",
            "https://hooks.acme.example/batches",
            "--events",
            "batch.completed,batch.failed",
        )
    )
    assert added["events"] == ["batch.completed", "batch.failed"]
    assert added["id"] in cli("webhook", "list", "acme")
    refused = cli("webhook", "add", "acme", "http://hooks.acme.example", code=1)
    assert "'url' must be an HTTPS URL on a public host" in refused
    refused = cli("webhook", "add", "acme", "https://h.acme.example", "--events", "x", code=1)
    assert "unknown event types ['x']" in refused
    cli("webhook", "remove", "acme", added["id"])
    assert "no webhook endpoints" in cli("webhook", "list", "acme")
    assert "no webhook endpoint" in cli("webhook", "remove", "acme", added["id"], code=1)

    assert "no batch emails" in cli("email", "show", "acme")
    assert "Set smtp_host" in cli("email", "set", "acme", "ops@acme.example")
    assert cli("email", "show", "acme") == "ops@acme.example"
    assert "'email' must be one address" in cli("email", "set", "acme", "ops", code=1)
    cli("email", "off", "acme")
    assert "no batch emails" in cli("email", "show", "acme")


def admin_api(data: Path, *paths: str) -> list[Any]:
    """What the admin API answers for ``paths``, over the same database the CLI used."""

    async def read() -> list[Any]:
        settings = Settings(data_dir=data, local_engine=False, admin_token=TOKEN)
        async with (
            opened(settings) as backfill,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=backfill.app()),
                base_url="http://backfill.test",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as client,
        ):
            return [(await client.get(f"/admin/v1{path}")).json() for path in paths]

    return asyncio.run(read())


def test_read_commands_print_the_admin_apis_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = tmp_path / "data"
    runner = CliRunner()

    def cli(*args: str) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", str(data)])
        assert result.exit_code == 0, result.output
        return result.output

    cli("org", "create", "acme")
    empty = json.loads(cli("webhook", "list", "acme", "--json"))
    assert empty == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    assert json.loads(cli("email", "show", "acme", "--json")) == {"org": "acme", "email": None}
    added = json.loads(cli("webhook", "add", "acme", "https://hooks.acme.example/b"))
    cli("email", "set", "acme", "ops@acme.example")
    secret = json.loads(cli("webhook", "secret", "acme", "--json"))
    endpoints = json.loads(cli("webhook", "list", "acme", "--json"))
    email = json.loads(cli("email", "show", "acme", "--json"))

    api = admin_api(
        data, "/orgs/acme/webhook_secret", "/orgs/acme/webhooks", "/orgs/acme/notifications"
    )
    assert [secret, endpoints, email] == api
    assert secret["secret"].startswith("whsec_")
    assert endpoints["data"] == [added]
    assert email == {"org": "acme", "email": "ops@acme.example"}
    # Without --json, one endpoint per line with its id whole.
    assert cli("webhook", "list", "acme").split() == [
        added["id"],
        ",".join(added["events"]),
        added["url"],
    ]
