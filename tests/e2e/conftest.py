"""``backfill up`` exactly as a newcomer runs it: the managed llama.cpp engine included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    create_pg_database,
    drop_pg_database,
    free_port,
    start_simulator_process,
    wait_http,
)


def spawn_up(port: int, data: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start ``backfill up`` (local engine) and wait until it answers."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "backfill.cli", "up", "--port", str(port), "--data", str(data)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
    wait_http(f"http://127.0.0.1:{port}/healthz", process)
    return process


@pytest.fixture
def llama_server(tmp_path: Path) -> Iterator[ServerProcess]:
    port = free_port()
    data = tmp_path / "data"
    log = tmp_path / "server.log"
    server = ServerProcess(data, tmp_path / "none.toml", port, "", log, spawn_up(port, data, log))
    try:
        match = re.search(r"bf-[A-Za-z0-9_-]+", log.read_text())
        assert match, log.read_text()
        server.key = match.group(0)
        yield server
    finally:
        server.stop()


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    url = await create_pg_database()
    try:
        yield url
    finally:
        await drop_pg_database(url)


# A fast simulator for scale-out runs, where the engine must not be the bottleneck.
@pytest.fixture
def fast_sim() -> Iterator[SimulatorProcess]:
    process = start_simulator_process("--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "8")
    try:
        yield process
    finally:
        process.stop()
