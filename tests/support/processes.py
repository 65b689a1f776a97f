"""Backfill and the simulator as real processes, started with the benchmarks' launcher
(``bench.common``), so a change to how they start lands once."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import free_port, spawn_up, start_backfill, start_simulator, stop, wait_http
from tests.support.api import ADMIN_TOKEN
from tests.support.settings import write_sim_config


@dataclass
class SimulatorProcess:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"http://127.0.0.1:{self.port}/stats").json()
        return data

    def stop(self) -> None:
        stop(self.process, timeout_s=10)


def start_simulator_process(*args: str) -> SimulatorProcess:
    """``backfill simulate`` with ``args`` on a free port, once it answers."""
    process, url = start_simulator(*args)
    port = urlsplit(url).port
    assert port is not None, url
    return SimulatorProcess(process, port)


@contextmanager
def simulator_process(*args: str) -> Iterator[SimulatorProcess]:
    """``backfill simulate`` with ``args`` as a real process while the block runs."""
    process = start_simulator_process(*args)
    try:
        yield process
    finally:
        process.stop()


@dataclass
class ServerProcess:
    data_dir: Path
    config: Path
    port: int
    key: str
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )

    def kill(self) -> None:
        """SIGKILL: no chance to clean up."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart(self) -> None:
        self.process = spawn_up(self.config, self.data_dir, self.port, self.log)
        wait_http(f"http://127.0.0.1:{self.port}/healthz", self.process)

    def stop(self) -> None:
        stop(self.process, timeout_s=10)


def start_server_process(
    tmp_path: Path, sim_url: str, *, max_concurrency: int = 32, extra: str = ""
) -> ServerProcess:
    """``backfill up`` on a free port with the simulator at ``sim_url`` as its engine."""
    config = tmp_path / "backfill.toml"
    write_sim_config(config, sim_url, max_concurrency=max_concurrency, extra=extra)
    return serve_config(tmp_path, config)


def serve_config(tmp_path: Path, config: Path) -> ServerProcess:
    """``backfill up`` on a free port with ``config``, its data and log in ``tmp_path``."""
    data_dir = tmp_path / "data"
    log = tmp_path / "server.log"
    process, base, key = start_backfill(config, data_dir, log)
    port = urlsplit(base).port
    assert port is not None, base
    return ServerProcess(data_dir, config, port, key, log, process)


@contextmanager
def backfill_process(
    tmp_path: Path, sim_url: str, *, max_concurrency: int = 32, extra: str = ""
) -> Iterator[ServerProcess]:
    """``backfill up`` as a real process while the block runs (see ``start_server_process``)."""
    server = start_server_process(tmp_path, sim_url, max_concurrency=max_concurrency, extra=extra)
    try:
        yield server
    finally:
        server.stop()


def batch_cli(
    server: ServerProcess,
    *args: str,
    columns: int = 200,
    timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``backfill batch ARGS`` as a user runs it against ``server``: its key and address from
    the environment (with ``env`` added), a terminal ``columns`` wide."""
    return subprocess.run(
        [sys.executable, "-m", "backfill.cli", "batch", *args],
        capture_output=True,
        text=True,
        env=dict(
            os.environ,
            BACKFILL_API_KEY=server.key,
            BACKFILL_BASE_URL=server.base_url,
            COLUMNS=str(columns),
            **(env or {}),
        ),
        timeout=timeout_s,
        check=False,
    )


def serve_role(
    config: Path, role: str, log: Path, port: int | None = None
) -> subprocess.Popen[bytes]:
    """``backfill serve --role ROLE`` as a real process, its output appended to ``log``."""
    args = [sys.executable, "-m", "backfill.cli", "serve", "--role", role, "--config", str(config)]
    if port is not None:
        args += ["--port", str(port)]
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process at once, then wait for each (killing any that hangs)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        stop(process, timeout_s=10)


@contextmanager
def scale_out(
    tmp_path: Path, pg_url: str, sim_url: str, *, workers: int, max_concurrency: int = 8
) -> Iterator[int]:
    """An API process and ``workers`` worker processes on one PostgreSQL database, blobs on
    disk, planning every 0.5 s, against the simulator at ``sim_url``; the API's port."""
    config = tmp_path / "scale-out.toml"
    write_sim_config(
        config,
        sim_url,
        max_concurrency=max_concurrency,
        extra=f"""
database_url = "{pg_url}"
storage_url = "file://{tmp_path / "blobs"}"
master_key = "{base64.b64encode(os.urandom(32)).decode()}"
admin_token = "{ADMIN_TOKEN}"
plan_interval_s = 0.5
""",
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        processes.append(serve_role(config, "api", tmp_path / "api.log", port))
        wait_http(f"http://127.0.0.1:{port}/healthz", processes[0])
        processes += [
            serve_role(config, "worker", tmp_path / f"worker{i}.log") for i in range(workers)
        ]
        yield port
    finally:
        stop_all(processes)
