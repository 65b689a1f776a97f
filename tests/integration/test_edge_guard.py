"""The HTTP edge in process: the admin API and body limits decide from the headers, before the
body is read; failed authentications are braked per address; operational endpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Message

from backfill.simulator.server import Simulator
from tests.support import InProcess, chat_line, in_process_backfill, jsonl

Sim = tuple[str, Simulator]
ADMIN_TOKEN = "a" * 16 + "0123456789abcdef"
CAP = 4096


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    # How many body messages the app asked for.
    reads: int = 0
    sent: list[Message] = field(default_factory=list)

    def error(self) -> dict[str, Any]:
        assert self.headers["content-type"].startswith("application/json")
        assert self.headers.get("x-request-id")
        error: dict[str, Any] = orjson.loads(self.body)["error"]
        assert error["message"]
        return error


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    *,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
    client: tuple[str, int] = ("203.0.113.7", 40000),
) -> Answer:
    """One request straight through the ASGI app, its body given in ``chunks``."""
    pending = list(chunks)
    answer = Answer(0, {}, b"")

    async def receive() -> Message:
        answer.reads += 1
        if not pending:
            return {"type": "http.disconnect"}
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: Message) -> None:
        answer.sent.append(message)
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"backfill.test"), *headers],
        "client": client,
        "server": ("127.0.0.1", 8080),
    }
    await app(scope, receive, send)
    return answer


def json_headers(length: int | None, token: str | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json")]
    if length is None:
        headers.append((b"transfer-encoding", b"chunked"))
    else:
        headers.append((b"content-length", str(length).encode()))
    if token is not None:
        headers.append((b"authorization", b"Bearer " + token.encode()))
    return headers


@pytest.fixture
async def guarded(tmp_path: Path, sim: Sim) -> AsyncIterator[InProcess]:
    async with in_process_backfill(
        tmp_path, sim[0], admin_token=ADMIN_TOKEN, max_json_body_bytes=CAP
    ) as running:
        yield running


# ---- H1: the admin API decides from the headers -------------------------------------------


async def test_disabled_admin_api_answers_404_without_reading_the_body(backfill: InProcess) -> None:
    body = b'{"name":"' + b"a" * 1_000_000 + b'"}'
    answer = await call(
        backfill.backfill.app(),
        "POST",
        "/admin/v1/orgs",
        headers=json_headers(len(body)),
        chunks=[body],
    )
    assert answer.status == 404
    assert "admin API is disabled" in answer.error()["message"]
    assert answer.reads == 0
    assert answer.headers["connection"] == "close"


@pytest.mark.parametrize(
    "authorization",
    [None, b"Bearer wrong", b"Bearer " + ADMIN_TOKEN[:-1].encode(), b"Basic " + b"x" * 20],
)
async def test_admin_without_the_token_is_401_without_reading_the_body(
    guarded: InProcess, authorization: bytes | None
) -> None:
    headers = json_headers(None)
    if authorization is not None:
        headers.append((b"authorization", authorization))
    answer = await call(
        guarded.backfill.app(),
        "POST",
        "/admin/v1/orgs",
        headers=headers,
        chunks=[b"{" * 1000] * 50,
    )
    assert answer.status == 401
    assert answer.error()["code"] == "invalid_admin_token"
    assert answer.reads == 0


@pytest.mark.parametrize("given", [b"\xff", "é".encode(), b"\xff" * 32, ("é" * 16).encode()])
async def test_non_ascii_admin_token_is_401_not_500(guarded: InProcess, given: bytes) -> None:
    answer = await call(
        guarded.backfill.app(),
        "GET",
        "/admin/v1/models",
        headers=[(b"authorization", b"Bearer " + given)],
        chunks=[],
    )
    assert answer.status == 401
    assert answer.error()["code"] == "invalid_admin_token"


async def test_admin_with_the_token_still_works(guarded: InProcess) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    created = await guarded.client.post("/admin/v1/orgs", json={"name": "acme"}, headers=admin)
    assert created.status_code == 200, created.text
    assert created.json()["name"] == "acme"


async def test_big_admin_body_with_the_token_is_413(guarded: InProcess) -> None:
    body = b'{"name":"' + b"a" * (CAP * 4) + b'"}'
    answer = await call(
        guarded.backfill.app(),
        "POST",
        "/admin/v1/orgs",
        headers=json_headers(len(body), ADMIN_TOKEN),
        chunks=[body],
    )
    assert answer.status == 413
    assert answer.reads == 0


# ---- M5: JSON bodies are capped ---------------------------------------------------------


async def test_declared_json_body_over_the_limit_is_413_from_the_headers(
    guarded: InProcess,
) -> None:
    answer = await call(
        guarded.backfill.app(),
        "POST",
        "/v1/batches",
        headers=json_headers(200 * 2**20, guarded.key),
        chunks=[b"{}"],
    )
    assert answer.status == 413
    error = answer.error()
    assert error["code"] == "request_too_large"
    assert str(CAP) in error["message"]
    assert answer.headers["x-should-retry"] == "false"
    assert answer.headers["connection"] == "close"
    assert answer.reads == 0


async def test_streamed_json_body_is_cut_at_the_limit(guarded: InProcess) -> None:
    chunk = b" " * 1024
    answer = await call(
        guarded.backfill.app(),
        "POST",
        "/v1/batches",
        headers=json_headers(None, guarded.key),
        chunks=[chunk] * 1000,
    )
    assert answer.status == 413
    assert answer.error()["code"] == "request_too_large"
    # Read up to the first chunk past the limit, then no more; only one answer was sent.
    assert answer.reads == CAP // len(chunk) + 1
    assert [m["type"] for m in answer.sent] == ["http.response.start", "http.response.body"]
    assert (await guarded.client.get("/v1/batches")).json()["data"] == []


async def test_json_body_under_the_limit_is_served(guarded: InProcess) -> None:
    uploaded = await guarded.upload(jsonl([chat_line("a")]))
    file_id = uploaded.json()["id"]
    metadata = {f"k{i}": "v" * 100 for i in range(16)}
    created = await guarded.create(file_id, metadata=metadata)
    assert created.status_code == 200, created.text


async def test_upload_is_not_held_to_the_json_limit(guarded: InProcess) -> None:
    rows = [chat_line(f"line-{i}", "x" * 200) for i in range(100)]
    content = jsonl(rows)
    assert len(content) > 4 * CAP
    uploaded = await guarded.upload(content)
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["bytes"] == len(content)


# ---- org API keys are read with the same Bearer parsing as the admin token -----------------


@pytest.mark.parametrize(
    ("authorization", "status"),
    [("bearer   {key}  ", 200), ("Basic {key}", 401), ("Bearer \xff{key}", 401)],
)
async def test_org_key_bearer_parsing(guarded: InProcess, authorization: str, status: int) -> None:
    value = authorization.format(key=guarded.key).encode("latin-1")
    answer = await call(
        guarded.backfill.app(),
        "GET",
        "/v1/files",
        headers=[(b"authorization", value)],
        chunks=[],
    )
    assert answer.status == status, answer.body


# ---- an answer before the body is read ends the connection ---------------------------------


async def test_answer_before_the_body_is_read_closes_the_connection(guarded: InProcess) -> None:
    # The upload authenticates before it reads its body; the rest of that body is not read.
    answer = await call(
        guarded.backfill.app(),
        "POST",
        "/v1/files",
        headers=[
            (b"content-type", b"multipart/form-data; boundary=b"),
            (b"content-length", b"100000"),
            (b"authorization", b"Bearer bf-wrong"),
        ],
        chunks=[b"-" * 1000] * 100,
    )
    assert answer.status == 401
    assert answer.reads == 0
    assert answer.headers["connection"] == "close"


async def test_answer_after_the_whole_body_keeps_the_connection(guarded: InProcess) -> None:
    for method, path, body in (("POST", "/v1/batches", b"{}"), ("GET", "/v1/files", b"")):
        answer = await call(
            guarded.backfill.app(),
            method,
            path,
            headers=json_headers(len(body), guarded.key),
            chunks=[body],
        )
        assert answer.status in (200, 400), answer.body
        assert "connection" not in answer.headers


# ---- L4: failed admin and metrics authentications are braked per address --------------------


async def test_repeated_failures_from_one_address_get_429(tmp_path: Path, sim: Sim) -> None:
    metrics_token = "m" * 40
    async with in_process_backfill(
        tmp_path,
        sim[0],
        admin_token=ADMIN_TOKEN,
        metrics_token=metrics_token,
        auth_failure_limit=3,
    ) as bf:
        app = bf.backfill.app()

        def client_at(address: str, key: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, client=(address, 1234)),
                base_url="http://backfill.test",
                headers={"Authorization": f"Bearer {key}"},
            )

        async with (
            client_at("198.51.100.1", "wrong") as guesser,
            client_at("198.51.100.2", ADMIN_TOKEN) as neighbour,
        ):
            # Org API keys are 256 random bits: their failures are not counted.
            for _ in range(10):
                assert (await guesser.get("/v1/files")).status_code == 401
            assert (await guesser.get("/admin/v1/models")).status_code == 401
            assert (await guesser.get("/metrics")).status_code == 401  # a metrics token too
            # Requests that pass are not slowed and do not count.
            for _ in range(5):
                assert (await neighbour.get("/admin/v1/models")).status_code == 200
            assert (await guesser.get("/admin/v1/models")).status_code == 401

            braked = await guesser.get("/admin/v1/models")
            assert braked.status_code == 429
            assert braked.json()["error"]["code"] == "too_many_auth_failures"
            assert 1 <= int(braked.headers["Retry-After"]) <= 60
            assert braked.headers.get("x-request-id")
            # While braked, even the right token waits: otherwise guessing goes on.
            right = await guesser.get(
                "/admin/v1/models", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            assert right.status_code == 429
            scrape = await guesser.get(
                "/metrics", headers={"Authorization": f"Bearer {metrics_token}"}
            )
            assert scrape.status_code == 429
            # Tenants sharing the address (behind a proxy, a NAT) are not locked out.
            tenant = await guesser.get("/v1/files", headers={"Authorization": f"Bearer {bf.key}"})
            assert tenant.status_code == 200
            assert (await guesser.get("/healthz")).status_code == 200
            assert (await neighbour.get("/admin/v1/models")).status_code == 200


async def test_ipv6_failures_are_counted_per_64(tmp_path: Path, sim: Sim) -> None:
    async with in_process_backfill(
        tmp_path, sim[0], admin_token=ADMIN_TOKEN, auth_failure_limit=3
    ) as bf:
        app = bf.backfill.app()

        async def admin_from(address: str) -> int:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, client=(address, 1234)),
                base_url="http://backfill.test",
                headers={"Authorization": "Bearer wrong"},
            ) as client:
                return (await client.get("/admin/v1/models")).status_code

        # One client rotating through its /64 is one client.
        for host in ("1", "2", "ffff:ffff:ffff"):
            assert await admin_from(f"2001:db8:0:7::{host}") == 401
        assert await admin_from("2001:db8:0:7::4") == 429
        assert await admin_from("2001:db8:0:8::1") == 401


# ---- L6: operational endpoints ------------------------------------------------------------


async def test_no_cdn_docs_pages_but_the_openapi_document(backfill: InProcess) -> None:
    for url in ("/docs", "/redoc"):
        assert (await backfill.client.get(url)).status_code == 404
    spec = await backfill.client.get("/openapi.json")
    assert spec.status_code == 200
    assert "/v1/batches" in spec.json()["paths"]
    assert not any(p.startswith("/admin") for p in spec.json()["paths"])


async def test_metrics_token_closes_metrics(tmp_path: Path, sim: Sim) -> None:
    token = "m" * 40
    async with in_process_backfill(tmp_path, sim[0], metrics_token=token) as bf:
        for authorization in (None, f"Bearer {bf.key}", "Bearer wrong"):
            request = bf.client.build_request("GET", "/metrics")
            del request.headers["Authorization"]
            if authorization:
                request.headers["Authorization"] = authorization
            response = await bf.client.send(request)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_metrics_token"
        scraped = await bf.client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert scraped.status_code == 200
        assert "backfill_queue_depth" in scraped.text


async def test_metrics_are_open_without_a_metrics_token(backfill: InProcess) -> None:
    assert (await backfill.client.get("/metrics", headers={"Authorization": ""})).status_code == 200
