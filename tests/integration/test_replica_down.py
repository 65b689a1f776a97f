"""Replicas of one model: when one goes away mid-drain, the lines claimed for it (running or
waiting in its backlog) go to the replica that is up; nothing is lost or charged twice."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.ports import Engine
from backfill.simulator.server import SimulatorConfig
from tests.support import assert_exactly_once, in_process_backfill, running_simulator
from tests.support.lines import SIM_MODEL, chat_line
from tests.support.waits import eventually


def replica(name: str, url: str) -> OpenAIHttpEngine:
    return OpenAIHttpEngine(
        name, url, {SIM_MODEL: SIM_MODEL}, max_concurrency=4, request_timeout_s=10.0
    )


async def test_a_replica_that_dies_mid_drain_leaves_its_lines_to_the_other(
    tmp_path: Path,
) -> None:
    # About 0.2 s a request: the drain is still going when one replica dies.
    slow = SimulatorConfig(ttft_ms=20, itl_ms=10, output_tokens=16)
    async with AsyncExitStack() as stack:
        url_a, _ = await stack.enter_async_context(running_simulator(slow))
        dying = AsyncExitStack()
        url_b, sim_b = await dying.enter_async_context(running_simulator(slow))
        engines: list[Engine] = [replica("a", url_a), replica("b", url_b)]
        bf = await stack.enter_async_context(in_process_backfill(tmp_path, url_a, engines=engines))
        rows = [chat_line(f"r{i}", f"question {i} " * (i % 7)) for i in range(60)]
        batch = await bf.submit(rows)

        async def b_took_some() -> bool:
            return sim_b.stats.requests >= 6

        await eventually(b_took_some, timeout_s=30)
        await dying.aclose()  # replica b is gone: refused connections from now on
        ended = await bf.wait(batch["id"], timeout_s=60)
        assert ended["status"] == "completed", ended
        out, err = await bf.rows(ended["output_file_id"]), await bf.rows(ended.get("error_file_id"))
        assert err == []
        assert_exactly_once(rows, out, err)
