"""Embeddings on the embedded default: ``backfill up`` starts its llama.cpp embedding engine
only once an embeddings batch waits for it, and the batch comes back as OpenAI's, billed for
its input tokens alone."""

from __future__ import annotations

import base64
import math
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import ServerProcess, batch_of, rows_of, submit

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-embedding"
ENGINE = b"llama_cpp.server"


def line(custom_id: str, value: str | list[str], **options: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": MODEL, "input": value, **options},
    }


ROWS = [
    line("a", "the cat sat"),
    line("b", "the cat sat"),
    line("c", "quarterly revenue grew by four percent"),
    line("d", ["the dog ran", "a bird sang", "the cat sat"]),
    # llama.cpp ignores both options: Backfill shapes its answer as asked.
    line("e", "the cat sat", dimensions=8, encoding_format="base64"),
]


def _engines(parent: int) -> list[list[bytes]]:
    """The command lines of the llama.cpp servers ``parent`` runs (the tether becomes one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if ENGINE in cmdline and fields[0] != "Z" and int(fields[1]) == parent:
            found.append(cmdline)
    return found


def _embedding_engines(parent: int) -> int:
    return sum(b"--embedding" in cmdline for cmdline in _engines(parent))


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _vectors(row: dict[str, Any]) -> list[list[float]]:
    body = row["response"]["body"]
    assert body["object"] == "list"
    assert body["model"] == MODEL
    data = body["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    for d in data:
        assert d["object"] == "embedding"
        assert all(isinstance(x, float) and math.isfinite(x) for x in d["embedding"])
    assert body["usage"]["prompt_tokens"] > 0
    return [d["embedding"] for d in data]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.e2e
@pytest.mark.llama
def test_an_embeddings_batch_starts_the_engine_and_is_billed_for_input_only(
    llama_server: ServerProcess,
) -> None:
    pid = llama_server.process.pid
    # The chat engine starts with Backfill; the embedding engine waits for work.
    _wait(lambda: len(_engines(pid)) >= 1, 30, "the chat engine")
    time.sleep(3)  # a few of the worker's looks at the queue, with nothing waiting
    assert _embedding_engines(pid) == 0

    with llama_server.client() as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert models[MODEL]["batch"]["endpoints"] == ["/v1/embeddings"]
        price = int(models[MODEL]["batch"]["pricing"]["input"])

        batch_id = submit(client, ROWS, "/v1/embeddings")
        _wait(
            lambda: batch_of(client, batch_id)["status"] in ("completed", "failed", "expired"),
            180,
            "the batch",
        )
        batch = batch_of(client, batch_id)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert _embedding_engines(pid) == 1

        out = rows_of(client, batch["output_file_id"])
        assert rows_of(client, batch.get("error_file_id")) == []
        by_id = {row["custom_id"]: row for row in out}
        assert sorted(by_id) == ["a", "b", "c", "d", "e"]
        for row in out:
            assert row["id"].startswith("batch_req_")
            assert row["error"] is None
            assert row["response"]["status_code"] == 200
        (a,), (b,), (c,) = (_vectors(by_id[k]) for k in "abc")
        assert len(a) > 0
        assert _max_diff(a, b) <= 1e-6, "the same input, the same vector"
        assert _max_diff(a, c) > 1e-3, "different inputs, different vectors"
        array = _vectors(by_id["d"])
        assert len(array) == 3
        assert _max_diff(array[0], array[1]) > 1e-3
        packed = base64.b64decode(by_id["e"]["response"]["body"]["data"][0]["embedding"])
        short = struct.unpack("<8f", packed)
        norm = math.sqrt(sum(v * v for v in a[:8]))
        assert _max_diff(list(short), [v / norm for v in a[:8]]) <= 1e-5

        billed = 0
        for row in out:
            receipt = client.get(f"/v1/receipts/{row['response']['request_id']}").json()
            usage = receipt["usage"]
            assert usage["output_tokens"] == 0
            assert usage["input_tokens"] == row["response"]["body"]["usage"]["prompt_tokens"]
            assert int(receipt["amount"]["value"]) == usage["input_tokens"] * price
            billed += int(receipt["amount"]["value"])
        assert billed > 0
