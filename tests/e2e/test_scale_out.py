"""Scale-out: 2 API and 3 worker processes on PostgreSQL + S3 drain one batch; a worker is
SIGKILLed mid-run and the batch still completes with every custom_id exactly once."""

from __future__ import annotations

import base64
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support import (
    TERMINAL,
    SimulatorProcess,
    chat_line,
    free_port,
    jsonl,
    moto_endpoint,
    new_bucket,
    serve_role,
    stop_all,
    wait_http,
    write_sim_config,
)

REQUESTS = 5000


def _config(tmp_path: Path, pg_url: str, sim_url: str) -> Path:
    config = tmp_path / "scale-out.toml"
    key = base64.b64encode(os.urandom(32)).decode()
    write_sim_config(
        config,
        sim_url,
        max_concurrency=24,
        extra=f"""
database_url = "{pg_url}"
storage_url = "s3://{new_bucket()}/backfill"
s3_endpoint_url = "{moto_endpoint()}"
s3_access_key_id = "testing"
s3_secret_access_key = "testing"
master_key = "{key}"
""",
    )
    return config


def _cli(config: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "backfill.cli", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_two_apis_three_workers_survive_a_worker_kill(
    tmp_path: Path, pg_url: str, fast_sim: SimulatorProcess
) -> None:
    config = _config(tmp_path, pg_url, fast_sim.base_url)
    _cli(config, "db", "upgrade")
    _cli(config, "admin", "org", "create", "acme")
    key = _cli(config, "admin", "key", "create", "--org", "acme").splitlines()[-1]
    _cli(config, "admin", "credit", "add", "--org", "acme", "--usd", "100")

    processes: list[subprocess.Popen[bytes]] = []
    try:
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            processes.append(serve_role(config, "api", tmp_path / f"api{i}.log", port))
        workers = [serve_role(config, "worker", tmp_path / f"worker{i}.log") for i in range(3)]
        processes += workers
        for port, process in zip(ports, processes, strict=False):
            wait_http(f"http://127.0.0.1:{port}/healthz", process)
        clients = [
            httpx.Client(
                base_url=f"http://127.0.0.1:{p}",
                timeout=60,
                headers={"Authorization": f"Bearer {key}"},
            )
            for p in ports
        ]
        rows = [chat_line(f"r-{i}", f"question {i}") for i in range(REQUESTS)]
        uploaded = clients[0].post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
        )
        assert uploaded.status_code == 200, uploaded.text
        created = clients[1].post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        killed = False
        deadline = time.monotonic() + 240
        batch = created.json()
        pollers = itertools.cycle(clients)  # both API processes answer for the same batch
        while time.monotonic() < deadline:
            batch = next(pollers).get(f"/v1/batches/{batch_id}").json()
            done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
            if not killed and done >= REQUESTS // 5:
                workers[0].kill()
                workers[0].wait()
                killed = True
            if batch["status"] in TERMINAL:
                break
            time.sleep(0.2)
        assert killed, "the batch finished before a worker could be killed; make it bigger"
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}

        content = clients[0].get(f"/v1/files/{batch['output_file_id']}/content")
        ids = [json.loads(line)["custom_id"] for line in content.text.splitlines()]
        assert len(ids) == REQUESTS
        assert set(ids) == {f"r-{i}" for i in range(REQUESTS)}
        assert clients[1].get(f"/v1/files/{batch['error_file_id']}/content").text == ""

        ledger = json.loads(_cli(config, "admin", "org", "ledger", "acme"))
        assert ledger["receipts"] == REQUESTS, "every request charged exactly once"
        assert ledger["balance"] == ledger["credits"] - ledger["charges"]
        assert ledger["reserved"] == 0
    finally:
        stop_all(processes)
