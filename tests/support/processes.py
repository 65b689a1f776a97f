"""Backfill and the simulator as real processes, started with the benchmarks' launcher
(``bench.common``), so a change to how they start lands once."""

from __future__ import annotations

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

from bench.common import spawn_up, start_backfill, start_simulator, stop, wait_http
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
