"""The bug report, as a new user meets it: ``backfill up`` with an engine at a URL that has no
``/v1/models``. The log names the engine, its URL and the reason within seconds; ``backfill
admin engine list`` shows it unhealthy with that reason; the batch says what it waits on; and
no request content reaches the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import (
    ServerProcess,
    batch_of,
    chat_line,
    free_port,
    start_server_process,
    submit,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SECRET_PROMPT = "please-never-log-this-prompt"


@pytest.fixture
def no_models_endpoint(tmp_path: Path) -> Iterator[str]:
    """A web server that answers 404 to ``GET /v1/models`` (a plain file server)."""
    root = tmp_path / "www"
    root.mkdir()
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the file server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(10)


def admin(server: ServerProcess, *args: str) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "backfill.cli",
            "admin",
            *args,
            "--data",
            str(server.data_dir),
            "--config",
            str(server.config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="200"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def wait_for_line(log: Path, needle: str) -> str:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if needle in line:
                return line
        time.sleep(0.2)
    raise AssertionError(f"no log line with {needle!r}:\n{log.read_text()}")


def test_an_engine_without_v1_models_is_logged_listed_and_shown_to_the_owner(
    tmp_path: Path, no_models_endpoint: str
) -> None:
    server = start_server_process(tmp_path, no_models_endpoint)
    try:
        reason = "GET /v1/models answered HTTP 404"
        line = wait_for_line(server.log, f"engine sim ({no_models_endpoint}) is down")
        assert " WARNING backfill.runner " in line
        assert reason in line
        assert "requests for sim-model wait in the queue" in line

        listed = json.loads(admin(server, "engine", "list", "--json"))
        assert listed["object"] == "list"
        [engine] = listed["data"]
        assert (engine["id"], engine["url"], engine["healthy"]) == (
            "sim",
            no_models_endpoint,
            False,
        )
        assert engine["last_error"].startswith(reason)
        table = admin(server, "engine", "list")
        assert "DOWN" in table
        assert reason in table

        with server.client() as client:
            batch_id = submit(client, [chat_line("r0", SECRET_PROMPT)])
            waiting = batch_of(client, batch_id)["waiting_on"]
        assert waiting["code"] == "no_healthy_engine"
        assert "sim-model" in waiting["message"]
    finally:
        server.stop()
    assert SECRET_PROMPT not in server.log.read_text()
