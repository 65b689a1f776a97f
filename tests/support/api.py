"""A real Backfill's HTTP API as the end-to-end tests use it."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import httpx
import orjson

from tests.support.lines import TERMINAL, jsonl

ADMIN_TOKEN = "admin-token-for-the-e2e-deployments-0123456789"


def batch_of(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}")
    assert response.status_code == 200, response.text
    batch: dict[str, Any] = response.json()
    return batch


def ended(client: httpx.Client, batch_id: str, timeout_s: float = 60) -> dict[str, Any]:
    """The batch once it ends, polled every 0.1 s; the test fails past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = batch_of(client, batch_id)
        if batch["status"] in TERMINAL:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not end in {timeout_s}s")


def rows_of(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines()]


def assert_exactly_once(
    rows: list[dict[str, Any]], out: list[dict[str, Any]], err: list[dict[str, Any]]
) -> None:
    """Every custom_id of ``rows`` has exactly one row across the output and error files."""
    seen = Counter(r["custom_id"] for r in out + err)
    duplicated = sorted(c for c, n in seen.items() if n > 1)
    assert not duplicated, f"custom_ids with more than one row: {duplicated[:10]}"
    assert set(seen) == {r["custom_id"] for r in rows}


def submit(
    client: httpx.Client,
    rows: list[dict[str, Any]],
    endpoint: str = "/v1/chat/completions",
    **fields: Any,
) -> str:
    """Upload ``rows`` and create a 24h batch from them (with ``fields`` in the create body);
    returns the batch id."""
    uploaded = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
    )
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            **fields,
        },
    )
    assert created.status_code == 200, created.text
    batch_id: str = created.json()["id"]
    return batch_id


class Api:
    """A real Backfill's HTTP API, as an operator (``ADMIN_TOKEN``) and its orgs use it."""

    def __init__(self, port: int) -> None:
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self._admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def org(self, name: str, weight: int) -> dict[str, str]:
        """Create an org with credit and this weight; its API headers."""
        admin = self._admin
        assert (
            await self.client.post("/admin/v1/orgs", json={"name": name}, headers=admin)
        ).is_success
        key = await self.client.post("/admin/v1/keys", json={"org": name}, headers=admin)
        assert key.status_code == 200, key.text
        credit = {"org": name, "usd": "1000"}
        assert (await self.client.post("/admin/v1/credits", json=credit, headers=admin)).is_success
        patched = await self.client.patch(
            f"/admin/v1/orgs/{name}", json={"weight": weight}, headers=admin
        )
        assert patched.json()["weight"] == weight, patched.text
        return {"Authorization": f"Bearer {key.json()['key']}"}

    async def submit(
        self, headers: dict[str, str], rows: list[dict[str, Any]], **fields: Any
    ) -> str:
        """Upload ``rows`` and create a 24h chat batch of them (with ``fields`` in the create
        body); its id."""
        uploaded = await self.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
            headers=headers,
        )
        assert uploaded.status_code == 200, uploaded.text
        created = await self.client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                **fields,
            },
            headers=headers,
        )
        assert created.status_code == 200, created.text
        batch_id: str = created.json()["id"]
        return batch_id

    async def batch(self, headers: dict[str, str], batch_id: str) -> dict[str, Any]:
        got = await self.client.get(f"/v1/batches/{batch_id}", headers=headers)
        assert got.status_code == 200, got.text
        found: dict[str, Any] = got.json()
        return found

    async def rows(self, headers: dict[str, str], file_id: str) -> list[dict[str, Any]]:
        got = await self.client.get(f"/v1/files/{file_id}/content", headers=headers)
        assert got.status_code == 200, got.text
        return [orjson.loads(line) for line in got.content.splitlines()]
