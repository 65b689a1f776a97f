"""The audit log (docs/observability.md): every admin action and every state-changing key use
is recorded with who, what, when, from where and how it ended, through the real API and the
CLI; a failed action is recorded as failed; no row holds content or secrets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli
from tests.support import InProcess, chat_line, in_process_backfill, jsonl

TOKEN = "admin-token-for-audit-log-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NO_ENGINE_URL = "http://127.0.0.1:9/v1"
PROMPT = "the-unique-prompt-words-7f3e"


async def audit(bf: InProcess, **params: Any) -> dict[str, Any]:
    answer = await bf.client.get("/admin/v1/audit", params=params, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    page: dict[str, Any] = answer.json()
    return page


async def test_admin_actions_and_key_uses_are_recorded_with_their_outcome(
    tmp_path: Path,
) -> None:
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        c = bf.client
        made = await c.post("/admin/v1/orgs", json={"name": "acme"}, headers=ADMIN)
        assert made.status_code == 200, made.text
        key = await c.post("/admin/v1/keys", json={"org": "acme"}, headers=ADMIN)
        secret, key_id = key.json()["key"], key.json()["id"]
        bad_credit = await c.post(
            "/admin/v1/credits", json={"org": "acme", "usd": "lots"}, headers=ADMIN
        )
        assert bad_credit.status_code == 400
        unknown_org = await c.patch("/admin/v1/orgs/nobody", json={"weight": 2}, headers=ADMIN)
        assert unknown_org.status_code == 404

        # A key's uses: the default org's key uploads (not an audited action), creates and
        # cancels a batch, and fails to delete a file that is not there.
        uploaded = await bf.upload(jsonl([chat_line("r1", PROMPT)]))
        file_id = uploaded.json()["id"]
        batch = await c.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert batch.status_code == 200, batch.text
        batch_id = batch.json()["id"]
        assert (await c.post(f"/v1/batches/{batch_id}/cancel")).status_code == 200
        assert (await c.delete("/v1/files/file-nothere")).status_code == 404
        # Refused before anyone is known: no one's action, not recorded.
        anonymous = await c.post(
            f"/v1/batches/{batch_id}/cancel", headers={"Authorization": "Bearer sk-wrong"}
        )
        assert anonymous.status_code == 401

        page = await audit(bf, limit=100)
        rows = [(e["action"], e["target"], e["outcome"], e["status"]) for e in page["data"]]
        assert rows == [
            ("file.delete", "file-nothere", "failed", 404),
            ("batch.cancel", batch_id, "succeeded", 200),
            ("batch.create", batch_id, "succeeded", 200),
            ("org.update", "nobody", "failed", 404),
            ("credit.add", "acme", "failed", 400),
            ("key.create", key_id, "succeeded", 200),
            ("org.create", "acme", "succeeded", 200),
        ]
        by_action = {e["action"]: e for e in page["data"]}
        assert by_action["org.create"]["actor"] == "admin"
        assert by_action["org.create"]["org_id"] is None
        # The error's code only, never its message.
        assert by_action["credit.add"]["error"] == "invalid_value"
        assert by_action["file.delete"]["error"] is not None
        default_org = (await c.get("/v1/organization")).json()
        key_use = by_action["batch.create"]
        assert key_use["actor"].startswith("key_")
        assert key_use["org_id"] == default_org["id"]
        assert all(e["address"] == "127.0.0.1" for e in page["data"])
        assert all(e["id"].startswith("audit_") for e in page["data"])

        # Never content or secrets: no prompt, no key, no admin token, no error message.
        text = json.dumps(page)
        for secret_or_content in (PROMPT, secret, bf.key, TOKEN, "lots"):
            assert secret_or_content not in text

        # Pages newest first, by `after`; filters by org, action and actor.
        first = await audit(bf, limit=3)
        assert first["has_more"] is True
        rest = await audit(bf, limit=100, after=first["last_id"])
        assert [e["id"] for e in first["data"] + rest["data"]] == [e["id"] for e in page["data"]]
        cancels = await audit(bf, action="batch.cancel")
        assert [e["target"] for e in cancels["data"]] == [batch_id]
        admins = await audit(bf, actor="admin")
        assert len(admins["data"]) == 4
        default_name = default_org["name"]
        of_default = await audit(bf, org=default_name)
        assert {e["action"] for e in of_default["data"]} == {
            "batch.create",
            "batch.cancel",
            "file.delete",
        }
        refused = await c.get("/admin/v1/audit", params={"after": "nope"}, headers=ADMIN)
        assert refused.status_code == 400
        assert "audit entry id" in refused.json()["error"]["message"]
        assert (await c.get("/admin/v1/audit")).status_code == 401


async def test_a_change_and_its_audit_row_commit_together_once(tmp_path: Path) -> None:
    """The change's own transaction appends its row: one row, not a second one after."""
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        for name in ("one", "two"):
            made = await bf.client.post("/admin/v1/orgs", json={"name": name}, headers=ADMIN)
            assert made.status_code == 200
        taken = await bf.client.post("/admin/v1/orgs", json={"name": "one"}, headers=ADMIN)
        assert taken.status_code >= 400
        rows = (await audit(bf))["data"]
        assert [(e["action"], e["target"], e["outcome"]) for e in rows] == [
            ("org.create", "one", "failed"),
            ("org.create", "two", "succeeded"),
            ("org.create", "one", "succeeded"),
        ]


def test_cli_admin_actions_are_recorded_and_printed(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == code, result.output
        return result.output

    cli("org", "create", "acme")
    cli("credit", "add", "--org", "acme", "--usd", "12.50")
    cli("credit", "add", "--org", "nobody", "--usd", "1", code=1)
    cli("org", "show", "acme")  # a read: not recorded
    listing = json.loads(cli("audit", "--json"))
    rows = [(e["action"], e["target"], e["outcome"], e["address"]) for e in listing["data"]]
    assert rows == [
        ("credit.add", "nobody", "failed", "cli"),
        ("credit.add", "acme", "succeeded", "cli"),
        ("org.create", "acme", "succeeded", "cli"),
    ]
    table = cli("audit", "--action", "credit.add")
    assert "credit.add" in table
    assert "org.create" not in table
    assert "failed 404" in table
