"""A catalog entry is the same whichever source describes it: the TOML file, the admin API or
``backfill admin`` (SPEC §7.2, §11.3). All three build it with one function from one set of
defaults, so an entry given only its revision must come out alike."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from backfill.cli.admin import app as admin_cli
from backfill.cli.common import load, opened
from backfill.container import build
from backfill.domain.catalog import CatalogModel
from backfill.settings import DeploymentSettings, ModelSettings, Settings

TOKEN = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def cli(data: Path, *args: str) -> None:
    result = CliRunner().invoke(admin_cli, [*args, "--data", str(data)])
    assert result.exit_code == 0, result.output


async def configure_and_put(data: Path) -> None:
    """The TOML entries are seeded at start; the admin API then adds its own."""
    settings = Settings(
        data_dir=data,
        local_engine=False,
        admin_token=TOKEN,
        models=[ModelSettings(id="toml-model", model_config_id="rev-1")],
        deployments=[
            DeploymentSettings(
                id="toml-deployment",
                org="default",
                model_config_id="rev-1",
                microusd_per_gpu_second=5,
            )
        ],
    )
    backfill = build(settings, role="api")
    await backfill.init()
    try:
        await backfill.services.tenants.bootstrap()
        await backfill.seed_catalog()
        transport = httpx.ASGITransport(app=backfill.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://backfill.test") as c:
            put = await c.put(
                "/admin/v1/models/api-model", json={"model_config_id": "rev-1"}, headers=ADMIN
            )
            assert put.status_code == 200, put.text
            body = {"org": "default", "model_config_id": "rev-1", "microusd_per_gpu_second": 5}
            put = await c.put("/admin/v1/deployments/api-deployment", json=body, headers=ADMIN)
            assert put.status_code == 200, put.text
    finally:
        await backfill.store.close()


async def catalog(data: Path) -> dict[str, CatalogModel]:
    async with opened(load(None, data_dir=data, local_engine=False)) as backfill:
        return {m.id: m for m in await backfill.services.catalog.all()}


def test_each_source_builds_the_same_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = tmp_path / "data"
    asyncio.run(configure_and_put(data))
    cli(data, "model", "set", "cli-model", "--config-id", "rev-1")
    gpu = ["--org", "default", "--config-id", "rev-1", "--gpu-second-price", "5"]
    cli(data, "deployment", "set", "cli-deployment", *gpu)
    cli(data, "deployment", "set", "cli-vision", *gpu, "--modalities", "text,image")

    models = asyncio.run(catalog(data))
    toml_model, toml_deployment = models["toml-model"], models["toml-deployment"]
    for source in ("api", "cli"):
        assert dataclasses.replace(models[f"{source}-model"], id="toml-model") == toml_model
        deployment = dataclasses.replace(models[f"{source}-deployment"], id="toml-deployment")
        assert deployment == toml_deployment
    assert toml_model.modalities == frozenset({"text"})
    assert models["cli-vision"].modalities == frozenset({"text", "image"})


async def _publish(data: Path) -> list[httpx.Response]:
    settings = Settings(data_dir=data, local_engine=False, admin_token=TOKEN)
    backfill = build(settings, role="api")
    await backfill.init()
    try:
        transport = httpx.ASGITransport(app=backfill.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://backfill.test") as c:
            bodies = [
                {
                    "model_config_id": "v1",
                    "modalities": ["text", "image", "audio"],
                    "endpoints": ["/v1/chat/completions", "/v1/responses"],
                    "batch": {"input": 1, "output": 2},
                },
                {"model_config_id": "v1", "modalities": ["text", "video"]},
                {"model_config_id": "v1", "modalities": ["image"]},
                {"model_config_id": "v1", "endpoints": ["/v1/images/generations"]},
            ]
            return [
                await c.put("/admin/v1/models/vision", json=body, headers=ADMIN) for body in bodies
            ]
    finally:
        await backfill.store.close()


def test_admin_publishes_modalities_and_endpoints(tmp_path: Path) -> None:
    published, video, no_text, unknown = asyncio.run(_publish(tmp_path))
    assert published.status_code == 200, published.text
    batch = published.json()["batch"]
    assert batch["modalities"] == ["audio", "image", "text"]
    assert batch["endpoints"] == ["/v1/chat/completions", "/v1/responses"]
    for refused, param in ((video, "modalities"), (no_text, "modalities"), (unknown, "endpoints")):
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
    cli(
        tmp_path,
        "model",
        "set",
        "embedder",
        "--config-id",
        "e1",
        "--endpoints",
        "/v1/embeddings",
        "--input-price",
        "1",
        "--output-price",
        "0",
    )
    entry = asyncio.run(catalog(tmp_path))["embedder"]
    assert entry.endpoints == frozenset({"/v1/embeddings"})
