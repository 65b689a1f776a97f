"""A shared engine whose metrics cannot be read: its batch still completes (its limit follows
latency), and the failed reads are counted on Backfill's /metrics, where an operator sees why
nobody is given a slot back there."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from backfill.settings import EngineSettings
from backfill.simulator.server import SimulatorConfig
from tests.integration.test_waiting_on import shared_backfill
from tests.support import SIM_MODEL, chat_line, running_simulator


def _closed_port() -> int:
    """A port nothing listens on (bound for a moment, then released): reads are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_unreadable_metrics_are_counted_and_the_batch_completes(tmp_path: Path) -> None:
    async with running_simulator(SimulatorConfig(ttft_ms=1, itl_ms=1, slots=4)) as (url, _):
        engine = EngineSettings(
            name="shared",
            base_url=url,
            models=[SIM_MODEL],
            max_concurrency=4,
            mode="shared",
            slots=4,
            metrics_url=f"http://127.0.0.1:{_closed_port()}/metrics",
        )
        async with shared_backfill(tmp_path, url, engine) as bf:
            batch = await bf.run_batch([chat_line(f"r{i}", f"line {i}") for i in range(6)])
            assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
            text = (await bf.client.get("/metrics")).text
    found = re.search(
        r'^backfill_engine_metrics_unread_total\{engine="shared"\} (\S+)$', text, re.M
    )
    assert found, text
    assert float(found.group(1)) >= 1
