"""Batches of every input kind through Backfill and the simulator: images inline and fetched
(engines never see a user's URL), failed fetches as error rows, Responses and embeddings lines
billed from their own usage fields, and each model's endpoints in GET /v1/models."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp import web

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.domain import custom_ids, input_format
from backfill.domain.strict_lines import chat_run_py
from backfill.settings import ModelSettings, PricingSettings
from tests.support import InProcess, in_process_backfill, jsonl, running_simulator
from tests.tls_support import make_pki

VISION = "sim-vision"
EMBED = "sim-embed"
PRICES = PricingSettings(input=1_000_000, cached_input=500_000, output=2_000_000)
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 200
INLINE = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture
async def images() -> AsyncIterator[str]:
    """An HTTPS image host on 127.0.0.1 with a certificate from the test CA; its base URL."""

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def page(_: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="text/html")

    async def disguised(_: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", image)
    app.router.add_get("/page", page)
    app.router.add_get("/disguised.png", disguised)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=make_pki().server_context())
    await site.start()
    try:
        yield f"https://localhost:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _models() -> list[ModelSettings]:
    return [
        ModelSettings(
            id=VISION,
            model_config_id="sim-vision-v1",
            modalities=["text", "image", "audio"],
            endpoints=["/v1/chat/completions", "/v1/responses"],
            batch=PRICES,
        ),
        ModelSettings(
            id=EMBED, model_config_id="sim-embed-v1", endpoints=["/v1/embeddings"], batch=PRICES
        ),
    ]


async def _backfill(tmp: Path, sim_url: str, **overrides: Any) -> Any:
    ca = tmp / "ca.pem"
    ca.write_bytes(make_pki().ca_pem)
    engine = OpenAIHttpEngine("sim", sim_url, {VISION: VISION, EMBED: EMBED}, request_timeout_s=5)
    values = {"fetch_ca_file": ca, "fetch_timeout_s": 3.0, "models": _models(), **overrides}
    return in_process_backfill(tmp / "data", sim_url, engines=[engine], **values)


def _chat(custom_id: str, *parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": VISION,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": content}],
        },
    }


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def _run(backfill: InProcess, rows: list[dict[str, Any]], endpoint: str) -> dict[str, Any]:
    uploaded = await backfill.upload(jsonl(rows))
    assert uploaded.status_code == 200, uploaded.text
    created = await backfill.create(uploaded.json()["id"], endpoint=endpoint)
    assert created.status_code == 200, created.text
    return await backfill.wait(created.json()["id"])


async def _rows(backfill: InProcess, batch: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows = await backfill.rows(batch["output_file_id"]) + await backfill.rows(
        batch["error_file_id"]
    )
    return {row["custom_id"]: row for row in rows}


async def test_images_reach_the_engine_inline_only(tmp_path: Path, images: str) -> None:
    async with (
        running_simulator() as (url, _),
        await _backfill(tmp_path, url, fetch_allow_private=True) as backfill,
    ):
        batch = await _run(
            backfill,
            [
                _chat("inline", _image(INLINE)),
                _chat("remote", _image(f"{images}/cat.png"), _image(f"{images}/cat.png")),
                _chat("not-an-image", _image(f"{images}/page")),
                _chat("missing", _image(f"{images}/nothing.png")),
            ],
            "/v1/chat/completions",
        )
        rows = await _rows(backfill, batch)
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    for custom_id, count in (("inline", 1), ("remote", 2)):
        received = rows[custom_id]["response"]["body"]["backfill_simulator"]["received"]
        assert received["images"] == count
        assert received["image_bytes"] == count * len(PNG)
        assert received["image_types"] == ["image/png"] * count
    for custom_id, words in (("not-an-image", "text/html"), ("missing", "404")):
        row = rows[custom_id]
        assert row["response"] is None
        assert row["error"]["code"] == "image_fetch_failed"
        assert words in row["error"]["message"]


async def test_a_private_image_host_is_refused_when_the_row_runs(
    tmp_path: Path, images: str
) -> None:
    # The same URL spelled with JSON escapes is a remote image too, never passed on.
    escaped = _chat("escaped", _image("PLACEHOLDER"))
    escaped_line = jsonl([escaped]).replace(
        b"PLACEHOLDER", f"{images}/cat.png".replace("/", "\\/").encode()
    )
    async with running_simulator() as (url, _), await _backfill(tmp_path, url) as backfill:
        content = (
            jsonl([_chat("private", _image(f"{images}/cat.png")), _chat("fine", _image(INLINE))])
            + escaped_line
        )
        uploaded = await backfill.upload(content)
        assert uploaded.status_code == 200, uploaded.text
        created = await backfill.create(uploaded.json()["id"])
        batch = await backfill.wait(created.json()["id"])
        rows = await _rows(backfill, batch)
    assert batch["status"] == "completed"
    assert rows["fine"]["response"]["status_code"] == 200
    for custom_id in ("private", "escaped"):
        error = rows[custom_id]["error"]
        assert error["code"] == "image_fetch_failed"
        assert "loopback" in error["message"] or "private" in error["message"]


async def test_responses_lines_are_billed_from_their_usage(tmp_path: Path) -> None:
    line = {
        "custom_id": "r-1",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": VISION, "input": "Say hi", "max_output_tokens": 4},
    }
    async with running_simulator() as (url, _), await _backfill(tmp_path, url) as backfill:
        batch = await _run(backfill, [line], "/v1/responses")
        (row,) = (await _rows(backfill, batch)).values()
        body = row["response"]["body"]
        assert body["object"] == "response"
        receipt = (
            await backfill.client.get(f"/v1/receipts/{row['response']['request_id']}")
        ).json()
    usage = body["usage"]
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] > 0
    assert (receipt["usage"]["input_tokens"], receipt["usage"]["output_tokens"]) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )
    assert batch["usage"]["output_tokens"] == usage["output_tokens"]


async def test_embeddings_lines_are_billed_for_input_tokens_only(tmp_path: Path) -> None:
    rows = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBED, "input": text},
        }
        for i, text in enumerate(["a cat", "a cat", "a dog"])
    ]
    async with running_simulator() as (url, _), await _backfill(tmp_path, url) as backfill:
        batch = await _run(backfill, rows, "/v1/embeddings")
        out = await _rows(backfill, batch)
        receipts = [
            (await backfill.client.get(f"/v1/receipts/{r['response']['request_id']}")).json()
            for r in out.values()
        ]
    vectors = {k: r["response"]["body"]["data"][0]["embedding"] for k, r in out.items()}
    assert vectors["e-0"] == vectors["e-1"] != vectors["e-2"]
    assert all(r["usage"]["output_tokens"] == 0 for r in receipts)
    assert all(r["usage"]["input_tokens"] > 0 for r in receipts)
    assert batch["usage"]["output_tokens"] == 0


async def test_models_say_which_endpoints_they_serve(tmp_path: Path) -> None:
    async with running_simulator() as (url, _), await _backfill(tmp_path, url) as backfill:
        models = {m["id"]: m for m in (await backfill.client.get("/v1/models")).json()["data"]}
        refused = await backfill.upload(
            jsonl([{**_chat("x"), "body": {**_chat("x")["body"], "model": EMBED}}])
        )
    assert models[VISION]["batch"]["endpoints"] == ["/v1/chat/completions", "/v1/responses"]
    assert models[VISION]["batch"]["modalities"] == ["audio", "image", "text"]
    assert models[EMBED]["batch"]["endpoints"] == ["/v1/embeddings"]
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"], error["line"]) == (
        400,
        "invalid_url",
        "url",
        1,
    )


@pytest.fixture(params=["c", "python"])
def validator_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Upload validation with the C fast path, or with its Python twins."""
    if request.param == "c":
        yield "c"
        return
    with (
        mock.patch.object(input_format, "chat_run", chat_run_py),
        mock.patch.object(custom_ids, "add_ids", custom_ids.add_ids_py),
        mock.patch.object(custom_ids, "rehash", custom_ids.rehash_py),
    ):
        yield "python"


def _response(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": VISION, "input": "Say hi", "max_output_tokens": 4, **body},
    }


def _text_chat(custom_id: str, **body: Any) -> dict[str, Any]:
    line = _chat(custom_id)
    line["body"]["messages"] = [{"role": "user", "content": "What is this?"}]
    line["body"].update(body)
    return line


METADATA_URL = "http://169.254.169.254/latest/"
FUNCTION_TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
# The 2026-12-05 review, finding L6: each of these uploaded, and the engine got the tools and
# the stored-response reference.
REACHING: list[tuple[Callable[..., dict[str, Any]], dict[str, Any], str]] = [
    (
        _response,
        {"tools": [{"type": "mcp", "server_label": "m", "server_url": METADATA_URL}]},
        "body.tools[0].type",
    ),
    (
        _response,
        {"tools": [{"type": "file_search", "vector_store_ids": ["vs_other_tenant"]}]},
        "body.tools[0].type",
    ),
    (_response, {"previous_response_id": "resp_other_tenant"}, "body.previous_response_id"),
    (_response, {"conversation": "conv_other_tenant"}, "body.conversation"),
    (_response, {"store": True}, "body.store"),
    (_text_chat, {"tools": [{"type": "mcp", "server_url": METADATA_URL}]}, "body.tools[0].type"),
    (_text_chat, {"web_search_options": {}}, "body.web_search_options"),
    (_text_chat, {"store": True}, "body.store"),
]


async def test_lines_that_reach_past_the_request_are_refused_at_upload(
    tmp_path: Path, validator_path: str
) -> None:
    async with running_simulator() as (url, _), await _backfill(tmp_path, url) as backfill:
        for make, body, param in REACHING:
            # Good lines first, so the bad one is checked by the path most lines take.
            rows = [make(f"ok-{i}") for i in range(3)] + [make("bad", **body)]
            answer = await backfill.upload(jsonl(rows))
            assert answer.status_code == 400, (validator_path, param, answer.text)
            error = answer.json()["error"]
            assert (error["param"], error["line"]) == (param, 4), error
            assert error["code"] in ("invalid_value", "unsupported_parameter")
            assert error["message"].startswith(f"Line 4: '{param}'"), error["message"]
        # Function tools are a JSON schema and nothing more; store: false asks for nothing.
        fine = [
            _response("r-1", tools=[FUNCTION_TOOL], store=False),
            _response("r-2", previous_response_id=None),
        ]
        batch = await _run(backfill, fine, "/v1/responses")
        assert batch["request_counts"]["total"] == 2
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        accepted = await backfill.upload(jsonl([_text_chat("c-1", tools=tools, store=False)]))
        assert accepted.status_code == 200, accepted.text


@pytest.fixture
async def plain_images() -> AsyncIterator[str]:
    """A plain-http image host on 127.0.0.1; its base URL."""

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", image)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_http_images_are_accepted_and_fetched_exactly_when_fetch_allow_http_is_on(
    tmp_path: Path, plain_images: str, validator_path: str
) -> None:
    # The 2026-12-05 review, Info: with fetch_allow_http on, an http image URL was still
    # refused at upload (only redirect hops honoured the setting).
    rows = [_text_chat(f"text-{i}") for i in range(3)]
    rows.append(_chat("http", _image(f"{plain_images}/cat.png")))
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    async with running_simulator() as (url, _):
        async with await _backfill(tmp_path / "off", url, fetch_allow_private=True) as backfill:
            refused = await backfill.upload(jsonl(rows))
        async with await _backfill(
            tmp_path / "on", url, fetch_allow_private=True, fetch_allow_http=True
        ) as backfill:
            batch = await _run(backfill, rows, "/v1/chat/completions")
            fetched = await _rows(backfill, batch)
    assert refused.status_code == 400, (validator_path, refused.text)
    error = refused.json()["error"]
    assert (error["line"], error["param"]) == (4, "body.messages[0].content[1].image_url.url")
    assert "https://" in error["message"]
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    received = fetched["http"]["response"]["body"]["backfill_simulator"]["received"]
    assert (received["images"], received["image_bytes"]) == (1, len(PNG))


async def test_an_image_whose_bytes_are_not_its_type_ends_its_row(
    tmp_path: Path, images: str
) -> None:
    async with (
        running_simulator() as (url, _),
        await _backfill(tmp_path, url, fetch_allow_private=True) as backfill,
    ):
        batch = await _run(
            backfill,
            [_chat("disguised", _image(f"{images}/disguised.png")), _chat("fine", _image(INLINE))],
            "/v1/chat/completions",
        )
        rows = await _rows(backfill, batch)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    error = rows["disguised"]["error"]
    assert error["code"] == "image_fetch_failed"
    assert "the body is not image/png" in error["message"]
