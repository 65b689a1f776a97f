"""A SIGKILL of ``backfill up`` takes its managed engine along (SPEC §9.3).

Without this an engine outlives its parent (re-parented to init, still holding its port and
memory, an unauthenticated endpoint on loopback) and every restart adds another one.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import spawn_up
from tests.support import ServerProcess

ENGINE = b"llama_cpp.server"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _engines() -> dict[int, int]:
    """pid → parent pid of every running llama.cpp server on this machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if ENGINE in cmdline and _alive(int(entry.name)):
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _children_engines(parent: int) -> list[int]:
    return [pid for pid, ppid in _engines().items() if ppid == parent]


def _wait(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.e2e
@pytest.mark.llama
def test_sigkill_takes_the_engine_along_and_a_restart_starts_one(
    llama_server: ServerProcess, tmp_path: Path
) -> None:
    _wait(lambda: len(_children_engines(llama_server.process.pid)) == 1)
    (engine,) = _children_engines(llama_server.process.pid)

    llama_server.kill()
    try:
        _wait(lambda: not _alive(engine), timeout_s=15)
    finally:
        if _alive(engine):  # an orphan would hold memory for the rest of the suite
            os.kill(engine, signal.SIGKILL)

    llama_server.process = spawn_up(llama_server.port, llama_server.data_dir, llama_server.log)
    _wait(lambda: len(_children_engines(llama_server.process.pid)) == 1)
    assert engine not in _engines()
