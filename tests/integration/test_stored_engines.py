"""A worker follows the engines stored for every worker (docs/fleet.md): one added through the
admin API is served within seconds; a change applies at once; a disabled engine takes no new
work; the CLI manages the same table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli
from backfill.runner.slots import EngineSlot
from backfill.simulator.server import SimulatorConfig
from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    InProcess,
    assert_exactly_once,
    chat_line,
    eventually,
    in_process_backfill,
    running_simulator,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SLOW = SimulatorConfig(ttft_ms=20, itl_ms=5, output_tokens=16)


def serving(bf: InProcess, name: str) -> EngineSlot | None:
    """The slot this worker serves ``name`` with now (None: it does not)."""
    assert bf.backfill.worker is not None
    found = [
        s for s in bf.backfill.worker.parts.pool.slots if s.engine.name == name and not s.retired
    ]
    return found[0] if found else None


async def test_the_worker_follows_what_is_added_changed_and_disabled(tmp_path: Path) -> None:
    async with (
        running_simulator(SLOW) as (url_a, sim_a),
        running_simulator(SLOW) as (url_b, sim_b),
        in_process_backfill(
            tmp_path,
            url_a,
            stored_engines=True,
            admin_token=ADMIN_TOKEN,
            worker={"engine_config_poll_s": 0.1},
        ) as bf,
    ):
        assert serving(bf, "sim") is not None, "the file's engine, seeded at start"
        body = {"name": "sim-b", "base_url": url_b, "models": [SIM_MODEL], "max_concurrency": 4}
        added = await bf.client.post("/admin/v1/engines", json=body, headers=ADMIN)
        assert added.status_code == 200, added.text
        assert added.json()["source"] == "api"

        async def limit_of_b() -> int | None:
            slot = serving(bf, "sim-b")
            return slot.governor.maximum if slot is not None else None

        await eventually(limit_of_b, lambda limit: limit == 4, 10, what="sim-b served")
        changed = await bf.client.patch(
            "/admin/v1/engines/sim-b", json={"max_concurrency": 2}, headers=ADMIN
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["max_concurrency"] == 2
        await eventually(limit_of_b, lambda limit: limit == 2, 10, what="the change applied")

        off = await bf.client.patch("/admin/v1/engines/sim", json={"enabled": False}, headers=ADMIN)
        assert off.json()["enabled"] is False

        async def sim_off() -> bool:
            return serving(bf, "sim") is None

        await eventually(sim_off, lambda off: off, 10, what="the disabled engine let go")
        before = sim_a.stats.requests
        rows = [chat_line(f"r{i}", f"question {i}") for i in range(40)]
        batch = await bf.run_batch(rows)
        assert batch["status"] == "completed", batch
        assert_exactly_once(rows, await bf.rows(batch["output_file_id"]), [])
        assert sim_a.stats.requests == before, "a disabled engine takes no new work"
        assert sim_b.stats.peak_in_flight <= 2, "sim-b held no more than its new limit"

        unknown = await bf.client.patch("/admin/v1/engines/nope", json={}, headers=ADMIN)
        assert unknown.status_code == 404
        assert "No engine named 'nope'" in unknown.json()["error"]["message"]
        bad = await bf.client.patch(
            "/admin/v1/engines/sim-b", json={"mode": "sometimes"}, headers=ADMIN
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["message"].startswith("mode:")


def test_the_cli_adds_changes_shows_and_removes_an_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    monkeypatch.setenv("VLLM_KEY", "engine-secret-from-env")
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == code, result.output
        return result.output.strip()

    added = json.loads(
        cli(
            *("engine", "add", "vllm-a", "--base-url", "http://10.0.0.5:8000/v1"),
            *("--model", "qwen", "--set", "max_concurrency=32", "--set", "mode=shared"),
            *("--api-key-env", "VLLM_KEY"),
        )
    )
    assert added["max_concurrency"] == 32
    assert added["mode"] == "shared"
    assert added["has_api_key"] is True
    changed = json.loads(cli("engine", "set", "vllm-a", "--set", "priority=10", "--disable"))
    assert changed["priority"] == 10
    assert changed["enabled"] is False
    assert changed["has_api_key"] is True
    shown = cli("engine", "show")
    assert "vllm-a  disabled  api  http://10.0.0.5:8000/v1  qwen" in shown
    assert "engine-secret-from-env" not in shown + cli("engine", "show", "vllm-a")
    refused = cli("engine", "set", "vllm-a", "--set", "max_concurrency=0", code=1)
    assert "max_concurrency" in refused
    cli("engine", "remove", "vllm-a")
    assert "No engine named 'vllm-a'" in cli("engine", "remove", "vllm-a", code=1)
    assert cli("engine", "show") == "No engine is stored."
