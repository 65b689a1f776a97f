"""Backfill in front of a real vLLM: every kind of line it sends, the usage vLLM reports
(prefix-cache hits included) reaching receipts at the cached price, and the metric names
Backfill reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backfill.adapters.engines import pressure
from bench import vllm
from bench.common import start_backfill, stop, wait_batch
from bench.vllm import VllmProcess
from tests.support import ServerProcess, batch_of, rows_of, submit
from tests.vllm.conftest import EMBED_MODEL, MODEL, PRICES, backfill_config, engine_table

pytestmark = pytest.mark.vllm

# Over two of vLLM's 128-token KV blocks on the CPU: a shared prefix long enough to be cached.
PREFIX = "You answer questions about the Backfill service in one short sentence. " * 30


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM's pooling runner over the same model: the embeddings engine."""
    log = tmp_path_factory.mktemp("vllm-embed") / "vllm.log"
    engine = vllm.start_vllm(log, extra=("--runner", "pooling", "--convert", "embed"))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, vllm_engine: VllmProcess, embedder: VllmProcess
) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("backfill")
    engines = engine_table("vllm", vllm_engine.base_url) + engine_table(
        "vllm-embed", embedder.base_url, models=EMBED_MODEL
    )
    config = backfill_config(tmp / "backfill.toml", engines)
    data, log = tmp / "data", tmp / "server.log"
    process, base, key = start_backfill(config, data, log)
    port = int(base.rsplit(":", 1)[1])
    try:
        yield ServerProcess(data, config, port, key, log, process)
    finally:
        stop(process)


def run_batch(server: ServerProcess, rows: list[dict[str, Any]], endpoint: str) -> list[Any]:
    with server.client() as client:
        batch = wait_batch(client, batch_of(client, submit(client, rows, endpoint)))
        assert batch["status"] == "completed", batch
        assert rows_of(client, batch.get("error_file_id")) == []
        out = rows_of(client, batch["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(r["custom_id"] for r in rows)
    for row in out:
        assert row["response"]["status_code"] == 200, row
    return out


def line(i: int, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}


def test_chat_and_completions_lines(server: ServerProcess) -> None:
    chat = [
        line(
            i,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Name a colour, number {i}."}],
                "max_tokens": 12,
                "temperature": 0,
            },
        )
        for i in range(6)
    ]
    for row in run_batch(server, chat, "/v1/chat/completions"):
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"]
        usage = body["usage"]
        assert 0 < usage["completion_tokens"] <= 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    completions = [
        line(i, "/v1/completions", {"model": MODEL, "prompt": f"{i} + {i} =", "max_tokens": 4})
        for i in range(4)
    ]
    for row in run_batch(server, completions, "/v1/completions"):
        body = row["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == 4 or body["choices"][0]["finish_reason"]


def test_responses_lines(server: ServerProcess) -> None:
    rows = [
        line(i, "/v1/responses", {"model": MODEL, "input": f"Say {i}.", "max_output_tokens": 8})
        for i in range(3)
    ]
    for row in run_batch(server, rows, "/v1/responses"):
        body = row["response"]["body"]
        assert body["object"] == "response"
        assert body["status"] in ("completed", "incomplete")
        assert 0 < body["usage"]["output_tokens"] <= 8


def test_embeddings_lines(server: ServerProcess) -> None:
    rows = [
        line(i, "/v1/embeddings", {"model": EMBED_MODEL, "input": f"ticket {i}"}) for i in range(4)
    ]
    for row in run_batch(server, rows, "/v1/embeddings"):
        body = row["response"]["body"]
        assert body["object"] == "list"
        assert len(body["data"][0]["embedding"]) == 576  # SmolLM2-135M's hidden size
        assert body["usage"]["prompt_tokens"] > 0


def test_prefix_cache_hits_reach_receipts_at_the_cached_price(
    server: ServerProcess, vllm_engine: VllmProcess
) -> None:
    # The prefix is computed once outside the batch, so every line finds it in vLLM's cache.
    warm = httpx.post(
        f"{vllm_engine.base_url}/chat/completions",
        json={
            "model": vllm.SERVED_MODEL,
            "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": "?"}],
            "max_tokens": 1,
        },
        timeout=60,
    )
    assert warm.status_code == 200, warm.text
    rows = [
        line(
            i,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": PREFIX},
                    {"role": "user", "content": f"What is line {i}?"},
                ],
                "max_tokens": 6,
            },
        )
        for i in range(4)
    ]
    out = run_batch(server, rows, "/v1/chat/completions")
    with server.client() as client:
        for row in out:
            usage = row["response"]["body"]["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 256, usage  # two full blocks at least
            receipt = client.get(f"/v1/receipts/{row['response']['request_id']}")
            assert receipt.status_code == 200, receipt.text
            got = receipt.json()
            assert got["usage"]["input_tokens_details"]["cached_tokens"] == cached, got
            expected = (
                (usage["prompt_tokens"] - cached) * PRICES["input"]
                + cached * PRICES["cached_input"]
                + usage["completion_tokens"] * PRICES["output"]
            )
            assert got["amount"] == {
                "unit": "picousd",
                "value": str(expected),
                "usd": got["amount"]["usd"],
            }


def test_backfill_reads_the_real_metric_names(vllm_engine: VllmProcess) -> None:
    page = vllm_engine.metrics().encode()
    found = pressure.parse(page)
    assert found is not None, "Backfill found neither vLLM's nor SGLang's load gauges"
    flavor, load = found
    assert flavor is pressure.Flavor.VLLM
    assert load.kv_usage is not None, "no KV-cache use: vllm:kv_cache_usage_perc was renamed?"
    assert load.running >= 0
    assert load.waiting >= 0
    # The latency budget learns the engine's step time from its inter-token latency.
    assert load.itl_count is not None, "no vllm:inter_token_latency_seconds_count"
    assert load.itl_count > 0
    assert load.itl_sum_s is not None
    # ...against the sequences that ran, its tokens over its steps.
    assert load.steps is not None, "no vllm:iteration_tokens_total_count"
    assert load.steps > 0


def test_tier_is_wired() -> None:
    """The model folder is what the engine loads: a chat template and real weights."""
    assert (vllm.MODEL_DIR / "chat_template.jinja").exists()
    assert (vllm.MODEL_DIR / "model.safetensors").stat().st_size > 100_000_000
