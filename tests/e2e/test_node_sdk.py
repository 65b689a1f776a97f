"""Seed 004's Node.js examples, run with the npm ``openai`` package against a real ``backfill up``.

The scripts in ``tests/e2e/node/`` are the seed's examples with only the base URL, key and model
changed (read from ``BACKFILL_BASE_URL``, ``BACKFILL_API_KEY``, ``BACKFILL_MODEL``); each prints
one JSON document that these tests assert on. ``typed_example.ts`` is the same calls typed
with the SDK's own types, compiled with ``tsc --strict``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.receivers import WebhookReceiver, webhook_receiver
from tests.support import (
    SIM_MODEL,
    TERMINAL,
    ServerProcess,
    batch_of,
    chat_line,
    missing_infrastructure,
    rows_of,
    start_server_process,
    start_simulator_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NODE_PROJECT = Path(__file__).with_name("node")
MIN_NODE_MAJOR = 20
# The seed's webhook_url must be HTTPS on a public host; the test receiver is neither.
SERVER_EXTRA = """
webhook_allow_http = true
webhook_allow_private = true
max_unfinished_batches = 20
"""
# Slow enough (at 4 requests at a time) that the cancelled batch cannot finish first.
SLOW_BATCH_LINES = 400
BATCH_STATUSES = {"validating", "in_progress", "finalizing", *TERMINAL, "cancelling"}


@dataclass(frozen=True)
class Node:
    """``node`` and the installed project of Node scripts."""

    node: str
    npx: str
    project: Path


@dataclass(frozen=True)
class Up:
    server: ServerProcess
    receiver: WebhookReceiver


@pytest.fixture(scope="module")
def node() -> Node:
    """Node.js 20+ with the project's packages installed (``npm ci`` when they are not)."""
    node, npm, npx = shutil.which("node"), shutil.which("npm"), shutil.which("npx")
    if node is None or npm is None or npx is None:
        missing_infrastructure("Node.js 20 or newer with npm (`node`, `npm` and `npx` on PATH)")
    version = subprocess.run(
        [node, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE_MAJOR:
        missing_infrastructure(f"Node.js {MIN_NODE_MAJOR} or newer (this one is {version})")
    if not (NODE_PROJECT / "node_modules" / "openai" / "package.json").is_file():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_PROJECT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"npm ci failed in {NODE_PROJECT}:\n{done.stdout}{done.stderr}"
    return Node(node, npx, NODE_PROJECT)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """``backfill up`` on a simulated engine, and a receiver for the seed's webhook."""
    sim = start_simulator_process("--ttft-ms", "200", "--itl-ms", "0", "--output-tokens", "8")
    try:
        with webhook_receiver() as receiver:
            server = start_server_process(
                tmp_path_factory.mktemp("backfill"),
                sim.base_url,
                max_concurrency=4,
                extra=SERVER_EXTRA,
            )
            try:
                yield Up(server, receiver)
            finally:
                server.stop()
    finally:
        sim.stop()


def run_node(
    node: Node, up: Up, script: str, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one of the seed's scripts in ``cwd`` and return the JSON it printed."""
    # OPENAI_* variables of the machine would change what the SDK sends.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    clean |= {
        "BACKFILL_BASE_URL": up.server.base_url,
        "BACKFILL_API_KEY": up.server.key,
        "BACKFILL_MODEL": SIM_MODEL,
        **(env or {}),
    }
    done = subprocess.run(
        [node.node, str(node.project / script), *args],
        cwd=cwd,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"node {script} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_seed_workflow_upload_create_poll_download(node: Node, up: Up, tmp_path: Path) -> None:
    out = run_node(
        node, up, "workflow.mjs", cwd=tmp_path, env={"BACKFILL_WEBHOOK_URL": up.receiver.url}
    )

    uploaded = out["uploaded"]
    assert uploaded["object"] == "file"
    assert uploaded["purpose"] == "batch"
    assert uploaded["status"] == "processed"
    # Every byte of the stream arrived; the name is Backfill's own (docs/api.md).
    assert uploaded["bytes"] == (tmp_path / "batchinput.jsonl").stat().st_size
    assert uploaded["filename"] == f"{uploaded['id']}.jsonl"

    created = out["created"]
    assert created["object"] == "batch"
    assert created["input_file_id"] == uploaded["id"]
    assert created["status"] in ("validating", "in_progress")
    assert created["metadata"] == {"description": "nightly eval job"}
    assert created["webhook_url"] == up.receiver.url

    batch = out["retrieved"]
    assert out["statuses"][-1] == "completed", out["statuses"]
    assert set(out["statuses"]) <= BATCH_STATUSES
    assert batch["id"] == created["id"]
    assert batch["metadata"] == {"description": "nightly eval job"}
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    with up.server.client() as client:
        assert rows_of(client, batch["error_file_id"]) == []

    rows = [json.loads(line) for line in out["output"].splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["request-1", "request-2"]
    for row in rows:
        assert row["error"] is None
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["object"] == "chat.completion"

    [hook] = up.receiver.wait_for(1)
    assert hook.json == {
        "batch_id": batch["id"],
        "status": "completed",
        "metadata": {"description": "nightly eval job"},
    }


def test_for_await_visits_every_batch_across_pages(node: Node, up: Up, tmp_path: Path) -> None:
    with up.server.client() as client:
        mine = [submit(client, [chat_line(f"list-{i}")]) for i in range(3)]
        deadline = time.monotonic() + 60
        while any(batch_of(client, b)["status"] not in TERMINAL for b in mine):
            assert time.monotonic() < deadline, "the batches to list did not end"
            time.sleep(0.05)
        listed = client.get("/v1/batches", params={"limit": 100}).json()
    everything = [b["id"] for b in listed["data"]]
    assert not listed["has_more"]

    middle = mine[1]
    out = run_node(node, up, "list_batches.mjs", "2", middle, cwd=tmp_path)

    # Newest first, each batch once, the same as the server lists on one page.
    assert out["all"] == everything
    assert out["all"][:3] == mine[::-1]
    # Full pages of 2, then the rest: has_more is false on the last page, never an empty one.
    assert len(everything) >= 3
    pages, rest = divmod(len(everything), 2)
    assert out["pageSizes"] == [2] * pages + ([rest] if rest else [])
    # The seed's `after` example: the batches older than the one given.
    assert out["after"] == everything[everything.index(middle) + 1 :][:10]


def test_cancel_a_running_batch(node: Node, up: Up, tmp_path: Path) -> None:
    out = run_node(node, up, "cancel.mjs", str(SLOW_BATCH_LINES), cwd=tmp_path)

    assert out["created"]["request_counts"]["total"] == SLOW_BATCH_LINES
    assert out["cancelled"]["id"] == out["created"]["id"]
    assert out["cancelled"]["status"] in ("cancelling", "cancelled")
    assert set(out["statuses"]) <= {"cancelling", "cancelled"}, out["statuses"]
    ended = out["ended"]
    assert ended["status"] == "cancelled"
    assert ended["cancelled_at"] is not None
    assert ended["request_counts"]["completed"] < SLOW_BATCH_LINES
    # Cancelling an ended batch returns it unchanged.
    assert out["again"]["status"] == "cancelled"
    assert out["again"]["cancelled_at"] == ended["cancelled_at"]


def test_files_list_retrieve_delete(node: Node, up: Up, tmp_path: Path) -> None:
    out = run_node(node, up, "files.mjs", cwd=tmp_path)

    uploaded = out["uploaded"]
    assert uploaded["id"] in out["listed"]
    assert len(out["listed"]) == len(set(out["listed"]))
    assert {"id": uploaded["id"], "purpose": "batch"} in out["batchInputs"]
    assert {f["purpose"] for f in out["batchInputs"]} == {"batch"}
    assert out["retrieved"] == uploaded
    assert out["deleted"] == {"id": uploaded["id"], "object": "file", "deleted": True}

    gone = out["afterDelete"]
    assert gone["found"] is False
    assert gone["notFoundError"] is True, gone
    assert gone["status"] == 404
    assert gone["error"]["message"], gone


def test_typed_example_compiles_with_strict_tsc(node: Node) -> None:
    config = json.loads((node.project / "tsconfig.json").read_text())
    assert config["compilerOptions"]["strict"] is True
    done = subprocess.run(
        [node.npx, "--no-install", "tsc", "-p", "."],
        cwd=node.project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
