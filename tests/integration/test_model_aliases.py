"""Model aliases through the API (docs/api.md, "Model aliases"), on SQLite and PostgreSQL: a
line may name its model by an alias; the batch shows the model it resolved to, the engine is
sent its served name, and each row's ``response.body.model`` is what the engine answered."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.cli.admin import app as admin_cli
from backfill.cli.common import load, opened
from backfill.settings import ModelSettings, PricingSettings
from tests.support import (
    SIM_MODEL,
    SIM_PRICES,
    Attempt,
    InProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    jsonl,
    recording_simulator,
)
from tests.support.in_process import FAST

TOKEN = "admin-token-for-model-alias-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# The name the engine knows the simulated model by (its served name).
SERVED = "sim-served"
OTHER = "org/other-model"
PRICES = {"input": 100_000, "cached_input": 50_000, "output": 400_000}


def catalog() -> list[ModelSettings]:
    return [
        ModelSettings(
            id=SIM_MODEL,
            model_config_id="sim-model-v1",
            context_length=4096,
            max_output_tokens=1024,
            batch=SIM_PRICES,
            aliases=["sim-alias", "gpt-4o-mini"],
        ),
        ModelSettings(
            id=OTHER,
            model_config_id="other-v1",
            context_length=4096,
            max_output_tokens=1024,
            batch=SIM_PRICES,
            throughput_tokens_per_s=500,
        ),
    ]


@dataclass
class Running:
    bf: InProcess
    attempts: list[Attempt]

    @property
    def client(self) -> httpx.AsyncClient:
        return self.bf.client


@pytest.fixture(params=["sqlite", "postgresql"])
async def running(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Running]:
    url = await create_pg_database() if request.param == "postgresql" else ""
    try:
        async with recording_simulator(FAST) as (sim_url, _, attempts):
            engine = OpenAIHttpEngine(
                "sim",
                sim_url,
                {SIM_MODEL: SERVED, OTHER: OTHER},
                max_concurrency=8,
                request_timeout_s=10.0,
            )
            async with in_process_backfill(
                tmp_path,
                sim_url,
                engines=[engine],
                models=catalog(),
                database_url=url,
                admin_token=TOKEN,
            ) as bf:
                yield Running(bf, attempts)
    finally:
        if url:
            await drop_pg_database(url)


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


async def test_alias_lines_run_on_the_resolved_model(running: Running) -> None:
    bf = running.bf
    rows = [
        chat_line("by-alias", model="gpt-4o-mini"),
        chat_line("by-id", model=SIM_MODEL),
        chat_line("by-other-alias", model="sim-alias"),
    ]
    created = await bf.submit(rows)
    # The batch shows the catalog model the names resolved to, as one model.
    assert created["model"] == SIM_MODEL
    done = await bf.wait(created["id"])
    assert done["status"] == "completed", done
    assert done["model"] == SIM_MODEL
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = await bf.rows(done["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == ["by-alias", "by-id", "by-other-alias"]
    # The engine was asked under its served name, and each row keeps what it answered.
    assert {a.model for a in running.attempts} == {SERVED}
    assert {r["response"]["body"]["model"] for r in out} == {SERVED}
    # Receipts carry the resolved revision.
    receipt = await bf.client.get(f"/v1/receipts/{out[0]['response']['request_id']}")
    assert receipt.status_code == 200, receipt.text
    assert receipt.json()["model_config_id"] == "sim-model-v1"


@pytest.mark.parametrize("name", ["no-such-model", "GPT-4o-mini", "sim-alias "])
async def test_an_unknown_name_is_refused_with_its_line(running: Running, name: str) -> None:
    rows = [chat_line("a", model="sim-alias"), chat_line("b", model=name)]
    answer = await running.bf.upload(jsonl([chat_line("first", model=name), *rows]))
    error = error_of(answer, 400)
    assert (error["code"], error["line"], error["param"]) == ("model_not_found", 1, "body.model")
    assert error["message"].startswith("Line 1:")


async def test_another_models_name_in_the_file_is_mixed_models(running: Running) -> None:
    rows = [chat_line("a", model="sim-alias"), chat_line("b", model=SIM_MODEL)]
    answer = await running.bf.upload(jsonl([*rows, chat_line("c", model=OTHER)]))
    error = error_of(answer, 400)
    assert (error["code"], error["line"], error["param"]) == ("mixed_models", 3, "body.model")
    assert f"'sim-alias' (model '{SIM_MODEL}')" in error["message"]


async def test_models_list_each_model_once_with_its_aliases(running: Running) -> None:
    c = running.client
    listed = await c.get("/v1/models")
    assert listed.status_code == 200, listed.text
    models = {m["id"]: m for m in listed.json()["data"]}
    assert set(models) == {SIM_MODEL, OTHER}
    assert models[SIM_MODEL]["aliases"] == ["gpt-4o-mini", "sim-alias"]
    assert models[OTHER]["aliases"] == []
    # One model, by any of its names; its object names it by its id.
    for name in ("gpt-4o-mini", "sim-alias", SIM_MODEL):
        one = await c.get(f"/v1/models/{name}")
        assert one.status_code == 200, one.text
        assert one.json() == models[SIM_MODEL]
    # An id with a slash, as written or percent-encoded (the openai SDKs encode it).
    for path in (f"/v1/models/{OTHER}", "/v1/models/org%2Fother-model"):
        slashed = await c.get(path)
        assert slashed.status_code == 200, slashed.text
        assert slashed.json() == models[OTHER]
    missing = await c.get("/v1/models/GPT-4o-mini")
    error = error_of(missing, 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'GPT-4o-mini'" in error["message"]


async def test_a_name_in_use_is_refused_naming_who_holds_it(running: Running) -> None:
    c = running.client
    other = {"model_config_id": "other-v1", "batch": PRICES}
    for alias, holder in [("sim-alias", SIM_MODEL), (SIM_MODEL, SIM_MODEL)]:
        taken = await c.put(
            f"/admin/v1/models/{OTHER}", json={**other, "aliases": [alias]}, headers=ADMIN
        )
        error = error_of(taken, 400)
        assert (error["code"], error["param"]) == ("alias_taken", "aliases")
        assert f"{alias!r}" in error["message"]
        assert f"model {holder!r}" in error["message"]
    # An entry whose id is an alias already: the id is taken.
    for path, body in [
        ("/admin/v1/models/gpt-4o-mini", other),
        (
            "/admin/v1/deployments/gpt-4o-mini",
            {"org": "default", "model_config_id": "d", "microusd_per_gpu_second": 1},
        ),
    ]:
        error = error_of(await c.put(path, json=body, headers=ADMIN), 409)
        assert error["code"] == "model_id_taken"
        assert f"alias of model {SIM_MODEL!r}" in error["message"]
    own = await c.put(
        f"/admin/v1/models/{OTHER}", json={**other, "aliases": [OTHER]}, headers=ADMIN
    )
    assert error_of(own, 400)["param"] == "aliases"
    # Nothing of the refused changes was written.
    models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
    assert set(models) == {SIM_MODEL, OTHER}
    assert models[OTHER]["aliases"] == []


async def test_patch_changes_the_aliases_and_keeps_the_rest(running: Running) -> None:
    c = running.client
    patched = await c.patch(
        f"/admin/v1/models/{OTHER}", json={"aliases": ["other", "o"]}, headers=ADMIN
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["aliases"] == ["o", "other"]
    assert body["model_config_id"] == "other-v1"
    assert body["throughput_tokens_per_s"] == 500
    assert body["batch"]["pricing"]["input"] == "100000"
    repriced = await c.patch(
        f"/admin/v1/models/{OTHER}", json={"batch": {"input": 1, "output": 2}}, headers=ADMIN
    )
    assert repriced.status_code == 200, repriced.text
    assert repriced.json()["aliases"] == ["o", "other"]
    assert repriced.json()["batch"]["pricing"]["output"] == "2"
    # A PUT replaces the whole entry: no aliases given, none kept.
    put = await c.put(
        f"/admin/v1/models/{OTHER}", json={"model_config_id": "other-v2"}, headers=ADMIN
    )
    assert put.status_code == 200, put.text
    assert put.json()["aliases"] == []
    # Neither an alias nor an unknown id nor a deployment is a catalog model to patch.
    deployment = {"org": "default", "model_config_id": "d", "microusd_per_gpu_second": 1}
    made = await c.put("/admin/v1/deployments/dep", json=deployment, headers=ADMIN)
    assert made.status_code == 200, made.text
    for name in ("sim-alias", "nothing", "dep"):
        missing = await c.patch(f"/admin/v1/models/{name}", json={"aliases": []}, headers=ADMIN)
        assert error_of(missing, 404)["code"] == "model_not_found"
    unknown = await c.patch(f"/admin/v1/models/{OTHER}", json={"alias": ["x"]}, headers=ADMIN)
    assert error_of(unknown, 400)["param"] == "alias"
    bad = await c.patch(f"/admin/v1/models/{OTHER}", json={"aliases": ["tab\there"]}, headers=ADMIN)
    assert error_of(bad, 400)["param"] == "aliases"


async def test_an_alias_moves_for_new_uploads_and_a_file_keeps_its_model(
    running: Running,
) -> None:
    """The name is resolved when the file is uploaded: a file accepted before the alias moved
    still runs on the model it named then."""
    bf, c = running.bf, running.client
    before = await bf.upload(jsonl([chat_line("a", model="gpt-4o-mini")]))
    assert before.status_code == 200, before.text
    freed = await c.patch(f"/admin/v1/models/{SIM_MODEL}", json={"aliases": []}, headers=ADMIN)
    assert freed.status_code == 200, freed.text
    moved = await c.patch(
        f"/admin/v1/models/{OTHER}", json={"aliases": ["gpt-4o-mini"]}, headers=ADMIN
    )
    assert moved.status_code == 200, moved.text
    old = await bf.create(before.json()["id"])
    assert old.status_code == 200, old.text
    assert old.json()["model"] == SIM_MODEL
    new = await bf.submit([chat_line("b", model="gpt-4o-mini")])
    assert new["model"] == OTHER
    assert (await bf.wait(old.json()["id"]))["status"] == "completed"
    assert (await bf.wait(new["id"]))["status"] == "completed"
    assert {a.model for a in running.attempts} == {SERVED, OTHER}


async def test_a_rerun_stays_on_the_model_its_batch_ran_on(running: Running) -> None:
    bf, c = running.bf, running.client
    rows = [
        chat_line("ok", model="gpt-4o-mini"),
        chat_line("refused", "[[sim:status=400]]", model="gpt-4o-mini"),
    ]
    first = await bf.wait((await bf.submit(rows))["id"])
    assert first["request_counts"]["failed"] == 1, first
    rerun = await c.post(f"/v1/batches/{first['id']}/retry", json={})
    assert rerun.status_code == 200, rerun.text
    assert rerun.json()["model"] == SIM_MODEL
    assert (await bf.wait(rerun.json()["id"]))["request_counts"]["total"] == 1
    # The alias now means another model: the failed lines are not run there.
    await c.patch(f"/admin/v1/models/{SIM_MODEL}", json={"aliases": []}, headers=ADMIN)
    await c.patch(f"/admin/v1/models/{OTHER}", json={"aliases": ["gpt-4o-mini"]}, headers=ADMIN)
    moved = await c.post(f"/v1/batches/{first['id']}/retry", json={})
    error = error_of(moved, 409)
    assert error["code"] == "rerun_input_invalid"
    assert f"ran on model {SIM_MODEL!r}" in error["message"]
    assert f"now means model {OTHER!r}" in error["message"]


# ---- the CLI and the settings file ---------------------------------------------------------


def cli(data: Path, *args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(admin_cli, [*args, "--data", str(data)])
    assert result.exit_code == exit_code, result.output
    return result.output


def test_the_cli_sets_and_changes_aliases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = tmp_path / "data"
    prices = ["--input-price", "1", "--output-price", "2"]
    line = cli(
        data, "model", "set", "m", "--config-id", "r1", *prices, "--alias", "a", "--alias", "b"
    )
    assert "aliases a, b" in line
    line = cli(data, "model", "aliases", "m", "b", "c")
    assert "aliases b, c" in line
    assert "in/cached/out 1/1/2" in line
    taken = cli(data, "model", "set", "n", "--config-id", "r1", "--alias", "c", exit_code=1)
    assert "'c' is an alias of model 'm'" in taken
    listed = json.loads(cli(data, "model", "list", "--json"))
    assert {m["id"]: m["aliases"] for m in listed["data"]}["m"] == ["b", "c"]
    assert "aliases" not in cli(data, "model", "aliases", "m")
    assert cli(data, "model", "aliases", "nothing", "x", exit_code=1).count("nothing")

    # A configured model whose alias the database already gives another is skipped, with
    # a warning: the others still start.
    cli(data, "model", "aliases", "m", "c")
    settings = load(
        None,
        data_dir=data,
        local_engine=False,
        models=[
            ModelSettings(id="fresh", model_config_id="f1", aliases=["c"]),
            ModelSettings(
                id="fine", model_config_id="f1", batch=PricingSettings(input=1, output=1)
            ),
        ],
    )

    async def seeded() -> set[str]:
        async with opened(settings) as backfill:
            with caplog.at_level(logging.WARNING, "backfill.catalog"):
                await backfill.seed_catalog()
            return {m.id for m in await backfill.services.catalog.all()}

    seen = asyncio.run(seeded())
    assert {"m", "fine"} <= seen
    assert "fresh" not in seen
    assert "configured model fresh skipped: Alias 'c' is an alias of model 'm'" in caplog.text
