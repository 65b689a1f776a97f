"""A model id names one entry: a PUT through the admin API never moves a catalog model to a
private deployment, a deployment to the catalog, or a deployment to another org (the
2026-12-05 review, finding L5), and admin bodies refuse fields they do not have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.support import SIM_MODEL, InProcess, chat_line, in_process_backfill, jsonl

TOKEN = "admin-token-for-catalog-id-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NO_ENGINE_URL = "http://127.0.0.1:9/v1"
DEPLOYMENT = {"model_config_id": "dep-v1", "microusd_per_gpu_second": 5}


async def visible(bf: InProcess, key: str) -> set[str]:
    answer = await bf.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return {m["id"] for m in answer.json()["data"]}


def conflict(answer: httpx.Response, *words: str) -> None:
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_id_taken"
    assert error["type"] == "invalid_request_error"
    for word in (*words, "another id"):
        assert word in error["message"], error["message"]


async def test_an_id_in_use_is_not_moved_between_catalog_and_deployments(tmp_path: Path) -> None:
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        c = bf.client
        acme = await c.post("/admin/v1/orgs", json={"name": "acme"}, headers=ADMIN)
        assert acme.status_code == 200, acme.text
        made = await c.post("/admin/v1/keys", json={"org": "acme"}, headers=ADMIN)
        acme_key = made.json()["key"]

        # A catalog model's id, put as a private deployment of acme.
        taken = await c.put(
            f"/admin/v1/deployments/{SIM_MODEL}", json={"org": "acme", **DEPLOYMENT}, headers=ADMIN
        )
        conflict(taken, repr(SIM_MODEL), "catalog model")
        assert SIM_MODEL in await visible(bf, bf.key)
        uploaded = await bf.upload(jsonl([chat_line("r1")]))
        assert uploaded.status_code == 200, uploaded.text

        # The default org's private deployment, put as a catalog model or as acme's.
        put = await c.put(
            "/admin/v1/deployments/secret-dep", json={"org": "default", **DEPLOYMENT}, headers=ADMIN
        )
        assert put.status_code == 200, put.text
        owner = put.json()["owned_by"]
        published = await c.put(
            "/admin/v1/models/secret-dep", json={"model_config_id": "pub-v1"}, headers=ADMIN
        )
        conflict(published, "'secret-dep'", "private deployment", owner)
        given = await c.put(
            "/admin/v1/deployments/secret-dep", json={"org": "acme", **DEPLOYMENT}, headers=ADMIN
        )
        conflict(given, "'secret-dep'", owner, "cannot move")
        assert "secret-dep" not in await visible(bf, acme_key)
        assert "secret-dep" in await visible(bf, bf.key)

        # The same owner may still change its entry.
        changed = {"org": "default", **DEPLOYMENT, "gpu_count": 2}
        again = await c.put("/admin/v1/deployments/secret-dep", json=changed, headers=ADMIN)
        assert again.status_code == 200, again.text
        repriced = {"model_config_id": "sim-model-v1", "batch": {"input": 1, "output": 2}}
        again = await c.put(f"/admin/v1/models/{SIM_MODEL}", json=repriced, headers=ADMIN)
        assert again.status_code == 200, again.text


async def test_admin_bodies_refuse_fields_they_do_not_have(tmp_path: Path) -> None:
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], admin_token=TOKEN) as bf:
        c = bf.client
        # "pricing" for "batch": accepted and ignored, the model would be published unpriced.
        cases: list[tuple[str, str, dict[str, Any], str]] = [
            ("PUT", "/admin/v1/models/m", {"model_config_id": "m1", "pricing": {}}, "pricing"),
            (
                "PUT",
                "/admin/v1/models/m",
                {"model_config_id": "m1", "batch": {"input": 1, "output": 1, "cache": 1}},
                "batch.cache",
            ),
            ("PUT", "/admin/v1/deployments/d", {"org": "default", **DEPLOYMENT, "gpus": 2}, "gpus"),
            ("POST", "/admin/v1/orgs", {"name": "x", "weight": 2}, "weight"),
            ("POST", "/admin/v1/keys", {"org": "default", "scope": ["x"]}, "scope"),
            ("POST", "/admin/v1/credits", {"org": "default", "usd": "1", "memo": "x"}, "memo"),
        ]
        for method, path, body, field in cases:
            answer = await c.request(method, path, json=body, headers=ADMIN)
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]
            assert error["param"] == field, error
            assert f"'{field}'" in error["message"], error["message"]
        models = (await c.get("/admin/v1/models", headers=ADMIN)).json()["data"]
        assert {m["id"] for m in models} == {SIM_MODEL}
