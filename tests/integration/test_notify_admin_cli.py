"""``backfill admin webhook`` and ``backfill admin email`` against a real database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli


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
