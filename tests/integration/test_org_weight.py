"""An org's fair-share weight and priority cap through the admin API and the CLI: shown on
the org object, changed with PATCH or ``backfill admin org set``, and refused with a 400
naming the field (a refusal changes neither)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli
from backfill.domain.priority import DEFAULT_MAX_PRIORITY, MAX_PRIORITY
from backfill.domain.scheduling.fair_share import MAX_WEIGHT
from tests.support import in_process_backfill

TOKEN = "admin-token-for-org-weight-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NO_ENGINE_URL = "http://127.0.0.1:9/v1"


async def test_the_weight_is_shown_and_changed_through_the_admin_api(tmp_path: Path) -> None:
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        created = await bf.client.post("/admin/v1/orgs", json={"name": "acme"}, headers=ADMIN)
        assert created.status_code == 200, created.text
        org = created.json()
        assert (org["object"], org["name"], org["weight"]) == ("organization", "acme", 1)

        patched = await bf.client.patch("/admin/v1/orgs/acme", json={"weight": 3}, headers=ADMIN)
        assert patched.status_code == 200, patched.text
        assert patched.json() == {**org, "weight": 3}
        shown = await bf.client.get("/admin/v1/orgs/acme", headers=ADMIN)
        assert shown.json() == patched.json()
        stored = await bf.backfill.store.org_by_name("acme")
        assert stored is not None
        assert stored.weight == 3

        capped = await bf.client.patch(
            "/admin/v1/orgs/acme", json={"max_priority": 50}, headers=ADMIN
        )
        assert capped.json() == {**org, "weight": 3, "max_priority": 50}

        missing = await bf.client.patch("/admin/v1/orgs/nobody", json={"weight": 2}, headers=ADMIN)
        assert missing.status_code == 404, missing.text
        unauthorized = await bf.client.patch("/admin/v1/orgs/acme", json={"weight": 2})
        assert unauthorized.status_code == 401, unauthorized.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": MAX_WEIGHT + 1}, "weight"),
        ({"weight": 2.5}, "weight"),
        ({"weight": "3"}, "weight"),
        ({"weight": True}, "weight"),
        ({"weight": None}, "weight"),
        ({}, "weight"),
        ({"weight": 2, "priority": 9}, "priority"),
        ({"max_priority": MAX_PRIORITY + 1}, "max_priority"),
        ({"max_priority": -1}, "max_priority"),
        ({"max_priority": None}, "max_priority"),
        ({"weight": 2, "max_priority": "5"}, "max_priority"),
    ],
)
async def test_a_bad_weight_is_a_400_naming_the_field(
    tmp_path: Path, body: dict[str, Any], param: str
) -> None:
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        refused = await bf.client.patch("/admin/v1/orgs/default", json=body, headers=ADMIN)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error"
        assert refused.headers["x-should-retry"] == "false"
        stored = await bf.backfill.store.org_by_name("default")
        assert stored is not None
        assert (stored.weight, stored.max_priority) == (1, DEFAULT_MAX_PRIORITY)


def test_the_cli_sets_and_shows_the_weight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str) -> dict[str, Any]:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == 0, result.output
        shown: dict[str, Any] = json.loads(result.output)
        return shown

    assert runner.invoke(admin_cli, ["org", "create", "acme", "--data", data]).exit_code == 0
    assert cli("org", "show", "acme")["weight"] == 1
    assert cli("org", "set", "acme", "--weight", "5")["weight"] == 5
    assert cli("org", "show", "acme")["weight"] == 5

    refused = runner.invoke(admin_cli, ["org", "set", "acme", "--weight", "0", "--data", data])
    assert refused.exit_code == 1
    assert "'weight' must be from 1 to 1000" in refused.output
    assert cli("org", "show", "acme")["weight"] == 5

    assert cli("org", "show", "acme")["max_priority"] == DEFAULT_MAX_PRIORITY
    assert cli("org", "set", "acme", "--max-priority", "40")["max_priority"] == 40
    both = cli("org", "set", "acme", "--weight", "2", "--max-priority", "0")
    assert (both["weight"], both["max_priority"]) == (2, 0)
    capped = runner.invoke(
        admin_cli, ["org", "set", "acme", "--max-priority", "101", "--data", data]
    )
    assert capped.exit_code == 1
    assert "'max_priority' must be a whole number from 0 to 100" in capped.output
    # A refused cap beside a good weight changes neither.
    partly = runner.invoke(
        admin_cli, ["org", "set", "acme", "--weight", "7", "--max-priority", "101", "--data", data]
    )
    assert partly.exit_code == 1
    shown = cli("org", "show", "acme")
    assert (shown["weight"], shown["max_priority"]) == (2, 0)
    neither = runner.invoke(admin_cli, ["org", "set", "acme", "--data", data])
    assert neither.exit_code != 0
    assert "--max-priority" in neither.output
