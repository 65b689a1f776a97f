"""Shared fixtures: an in-process Backfill over ASGI, a simulated engine, real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from backfill.simulator.server import Simulator
from tests.support import (
    InProcess,
    ServerProcess,
    SimulatorProcess,
    backfill_process,
    in_process_backfill,
    running_simulator,
    simulator_process,
)


@pytest.fixture
async def sim() -> AsyncIterator[tuple[str, Simulator]]:
    """A simulated engine in this test's event loop: (base URL ending in /v1, simulator)."""
    async with running_simulator() as running:
        yield running


@pytest.fixture
async def backfill(tmp_path: Path, sim: tuple[str, Simulator]) -> AsyncIterator[InProcess]:
    """Backfill in this process, wired to ``sim``, with an API key for org ``default``."""
    async with in_process_backfill(tmp_path, sim[0]) as running:
        yield running


@pytest.fixture
def sim_process() -> Iterator[SimulatorProcess]:
    """``backfill simulate`` as a real process."""
    with simulator_process() as process:
        yield process


@pytest.fixture
def server_process(tmp_path: Path, sim_process: SimulatorProcess) -> Iterator[ServerProcess]:
    """``backfill up`` as a real process, its engine the simulator process."""
    with backfill_process(tmp_path, sim_process.base_url) as process:
        yield process
