"""API keys, scopes and org isolation over HTTP (SPEC §7.1, §4.7)."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from backfill.adapters.db import tables
from tests.support import InProcess, chat_line, jsonl

READ_ONLY = frozenset({"requests:read"})
BOTH = frozenset({"requests:read", "inference:write"})


def as_key(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


async def send(
    backfill: InProcess,
    method: str,
    url: str,
    *,
    authorization: str | None,
    **kwargs: Any,
) -> httpx.Response:
    """Send with exactly this Authorization header (``None``: no header at all)."""
    request = backfill.client.build_request(method, url, **kwargs)
    del request.headers["Authorization"]
    if authorization is not None:
        request.headers["Authorization"] = authorization
    return await backfill.client.send(request)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers.get("x-request-id")
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


async def uploaded_file(backfill: InProcess, key: str | None = None) -> str:
    content = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
    response = await backfill.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", content, "application/jsonl")},
        headers=as_key(key) if key else None,
    )
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


async def other_org_key(backfill: InProcess) -> str:
    tenants = backfill.backfill.services.tenants
    await tenants.create_org("other")
    return await tenants.create_key("other", BOTH)


# ---- 401 --------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["/v1/files", "/v1/batches", "/v1/models"])
async def test_no_key_is_401(backfill: InProcess, url: str) -> None:
    error = error_of(await send(backfill, "GET", url, authorization=None), 401)
    assert error["type"] == "invalid_request_error"
    assert error["code"] in {"missing_api_key", "invalid_api_key"}


async def test_bad_key_is_401(backfill: InProcess) -> None:
    forged = "bf-" + "x" * 43
    for key in (forged, backfill.key + "x", backfill.key[:-1]):
        response = await send(backfill, "GET", "/v1/files", authorization=f"Bearer {key}")
        error = error_of(response, 401)
        assert error["code"] == "invalid_api_key"
        assert key not in response.text


@pytest.mark.parametrize(
    "header",
    ["", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token {key}", "{key}", "Bearer{key}"],
)
async def test_malformed_authorization_is_401(backfill: InProcess, header: str) -> None:
    response = await send(
        backfill, "GET", "/v1/files", authorization=header.format(key=backfill.key)
    )
    error = error_of(response, 401)
    assert error["code"] in {"missing_api_key", "invalid_api_key"}


async def test_bearer_scheme_is_case_insensitive(backfill: InProcess) -> None:
    response = await send(backfill, "GET", "/v1/files", authorization=f"bearer {backfill.key}")
    assert response.status_code == 200


async def test_no_key_cannot_upload_or_create(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    files = {"file": ("input.jsonl", jsonl([chat_line("a")]), "application/jsonl")}
    upload = await send(
        backfill, "POST", "/v1/files", authorization=None, data={"purpose": "batch"}, files=files
    )
    error_of(upload, 401)
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    error_of(await send(backfill, "POST", "/v1/batches", authorization=None, json=body), 401)
    error_of(await send(backfill, "DELETE", f"/v1/files/{file_id}", authorization=None), 401)
    assert (await backfill.client.get("/v1/batches")).json()["data"] == []
    assert [f["id"] for f in (await backfill.client.get("/v1/files")).json()["data"]] == [file_id]


# ---- 403 --------------------------------------------------------------------------------


async def test_read_only_key_cannot_write_but_can_read(backfill: InProcess) -> None:
    reader = await backfill.backfill.services.tenants.create_key("default", READ_ONLY)
    headers = as_key(reader)
    file_id = await uploaded_file(backfill)
    batch = await backfill.run_batch([chat_line("done", "q")])

    upload = await backfill.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", jsonl([chat_line("x")]), "application/jsonl")},
        headers=headers,
    )
    assert error_of(upload, 403)["code"] == "insufficient_scope"
    create = await backfill.client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
        headers=headers,
    )
    assert error_of(create, 403)["code"] == "insufficient_scope"
    error_of(await backfill.client.delete(f"/v1/files/{file_id}", headers=headers), 403)
    cancel = await backfill.client.post(f"/v1/batches/{batch['id']}/cancel", headers=headers)
    error_of(cancel, 403)

    # Nothing was created or deleted.
    batches = (await backfill.client.get("/v1/batches")).json()["data"]
    assert [b["id"] for b in batches] == [batch["id"]]
    assert (await backfill.client.get(f"/v1/files/{file_id}")).status_code == 200

    # And everything reads.
    for url in (
        "/v1/files",
        f"/v1/files/{file_id}",
        f"/v1/files/{file_id}/content",
        f"/v1/files/{batch['output_file_id']}/content",
        "/v1/batches",
        f"/v1/batches/{batch['id']}",
        "/v1/models",
    ):
        response = await backfill.client.get(url, headers=headers)
        assert response.status_code == 200, (url, response.text)


async def test_read_only_key_sees_the_same_org(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    reader = await backfill.backfill.services.tenants.create_key("default", READ_ONLY)
    listed = (await backfill.client.get("/v1/files", headers=as_key(reader))).json()
    assert [f["id"] for f in listed["data"]] == [file_id]


# ---- 404 across orgs --------------------------------------------------------------------


async def test_another_orgs_objects_are_404(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("mine", "q")])
    file_id = batch["input_file_id"]
    output_id = batch["output_file_id"]
    stranger = as_key(await other_org_key(backfill))
    client = backfill.client

    for response in (
        await client.get(f"/v1/files/{file_id}", headers=stranger),
        await client.get(f"/v1/files/{file_id}/content", headers=stranger),
        await client.get(f"/v1/files/{output_id}", headers=stranger),
        await client.get(f"/v1/files/{output_id}/content", headers=stranger),
        await client.delete(f"/v1/files/{output_id}", headers=stranger),
        await client.get(f"/v1/batches/{batch['id']}", headers=stranger),
        await client.post(f"/v1/batches/{batch['id']}/cancel", headers=stranger, json={}),
        await client.post(
            "/v1/batches",
            headers=stranger,
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
        ),
    ):
        error = error_of(response, 404)
        assert error["type"] == "invalid_request_error"

    # The stranger lists nothing of ours, and our objects are untouched.
    assert (await client.get("/v1/files", headers=stranger)).json()["data"] == []
    assert (await client.get("/v1/batches", headers=stranger)).json()["data"] == []
    assert (await client.get(f"/v1/files/{output_id}")).status_code == 200
    assert (await client.get(f"/v1/batches/{batch['id']}")).json()["status"] == "completed"


async def test_404_for_another_org_looks_like_404_for_nothing(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    stranger = as_key(await other_org_key(backfill))
    theirs = await backfill.client.get(f"/v1/files/{file_id}", headers=stranger)
    missing = await backfill.client.get("/v1/files/file-000000000000000000000000", headers=stranger)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["code"] == missing.json()["error"]["code"]


# ---- headers on every response ----------------------------------------------------------


async def test_every_response_has_a_request_id(backfill: InProcess) -> None:
    file_id = await uploaded_file(backfill)
    responses = [
        await backfill.client.get("/v1/files"),
        await backfill.client.get(f"/v1/files/{file_id}/content"),
        await backfill.client.get("/v1/files/file-nope"),
        await backfill.client.get("/v1/no-such-route"),
        await backfill.client.post("/v1/batches", content=b"not json"),
        await send(backfill, "GET", "/v1/files", authorization=None),
        await backfill.client.get("/healthz"),
    ]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(ids), [(r.request.url, r.status_code) for r in responses]
    assert len(set(ids)) == len(ids)


async def test_unexpected_server_error_has_a_request_id(
    backfill: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug in a service")

    monkeypatch.setattr(backfill.backfill.services.files, "list_files", broken)
    # This client answers with the 500 the app sends instead of re-raising the bug.
    transport = httpx.ASGITransport(app=backfill.backfill.app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://backfill.test", headers=as_key(backfill.key)
    ) as client:
        response = await client.get("/v1/files")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "a bug in a service" not in response.text
    assert response.headers["x-should-retry"] == "true"
    assert response.headers.get("x-request-id")


async def test_4xx_responses_say_do_not_retry(backfill: InProcess) -> None:
    reader = as_key(await backfill.backfill.services.tenants.create_key("default", READ_ONLY))
    file_id = await uploaded_file(backfill)
    key = {"Idempotency-Key": "run-1"}
    first = await backfill.client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
        headers=key,
    )
    assert first.status_code == 200, first.text
    cases = [
        (await backfill.client.post("/v1/batches", content=b"not json"), 400),
        (await backfill.create(file_id, surprise=True), 400),
        (await send(backfill, "GET", "/v1/files", authorization="Bearer nope"), 401),
        (await backfill.client.post("/v1/batches", json={}, headers=reader), 403),
        (await backfill.client.get("/v1/batches/batch_nope"), 404),
        (await backfill.client.get("/v1/no-such-route"), 404),
        (await backfill.client.delete("/v1/files"), 405),
        (
            await backfill.client.post(
                "/v1/batches",
                json={
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "metadata": {"changed": "yes"},
                },
                headers=key,
            ),
            409,
        ),
    ]
    for response, status in cases:
        error_of(response, status)
    await backfill.wait(first.json()["id"])


# ---- key storage ------------------------------------------------------------------------


async def test_keys_are_stored_only_as_sha256_hashes(backfill: InProcess) -> None:
    tenants = backfill.backfill.services.tenants
    reader = await tenants.create_key("default", READ_ONLY)
    secrets = [backfill.key, reader]
    async with backfill.backfill.store.engine.connect() as conn:
        rows = [dict(r._mapping) for r in (await conn.execute(select(tables.api_keys))).all()]
    assert len(rows) == 2
    hashes = {hashlib.sha256(s.encode()).hexdigest() for s in secrets}
    assert {r["secret_hash"] for r in rows} == hashes
    for row in rows:
        stored = " ".join(str(v) for v in row.values())
        for secret in secrets:
            assert secret not in stored
            assert secret[len(row["prefix"]) :] not in stored
    # Nothing anywhere in the data directory holds a secret in the clear.
    for path in backfill.settings.data_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in secrets:
                assert secret.encode() not in data, path


async def test_keys_have_a_readable_prefix_and_enough_entropy(backfill: InProcess) -> None:
    tenants = backfill.backfill.services.tenants
    made = [await tenants.create_key("default", READ_ONLY) for _ in range(3)] + [backfill.key]
    assert len(set(made)) == len(made)
    for secret in made:
        assert secret.startswith("bf-")
        body = secret.removeprefix("bf-")
        # token_urlsafe characters carry 6 bits each; at least 128 bits.
        assert len(body) * 6 >= 128
    async with backfill.backfill.store.engine.connect() as conn:
        prefixes = (await conn.execute(select(tables.api_keys.c.prefix))).scalars().all()
    assert len(prefixes) == len(made)
    for prefix in prefixes:
        assert prefix.startswith("bf-")
        assert any(secret.startswith(prefix) for secret in made)
        assert len(prefix) < 16


async def test_a_new_key_works_at_once(backfill: InProcess) -> None:
    key = await backfill.backfill.services.tenants.create_key("default", BOTH)
    file_id = await uploaded_file(backfill, key)
    response = await backfill.client.get(f"/v1/files/{file_id}", headers=as_key(key))
    assert response.status_code == 200
