"""The priority probe against the real vLLM: an engine started with ``--scheduling-policy
fcfs`` (vLLM's default) takes the ``priority`` field and ignores it, one started with
``priority`` applies it, and the probe tells the two apart."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from backfill.adapters.engines.pressure import Flavor, parse
from backfill.adapters.engines.priority_probe import VllmPriorityProbe
from backfill.domain.engine_health import PriorityOutcome
from backfill.runner.engine_pool import PRIORITY_TRIES
from bench import vllm
from tests.support.waits import eventually
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm

SLOTS = 4


async def _idle(engine: vllm.VllmProcess) -> bool:
    found = parse(engine.metrics().encode(), Flavor.VLLM)
    return found is not None and found[1].running + found[1].waiting == 0


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", PriorityOutcome.IGNORED), ("priority", PriorityOutcome.APPLIED)],
)
async def test_the_probe_tells_whether_vllm_applies_priority(
    tmp_path: Path, policy: Literal["fcfs", "priority"], expected: PriorityOutcome
) -> None:
    require_vllm()
    engine = vllm.start_vllm(tmp_path / "vllm.log", max_num_seqs=SLOTS, policy=policy)
    try:
        probe = VllmPriorityProbe(engine.base_url, vllm.SERVED_MODEL, SLOTS, 10)
        assert await told(probe, engine, policy) == expected, probe.unknown_reason
        # A second look agrees.
        assert await told(probe, engine, policy) == expected, probe.unknown_reason
    finally:
        engine.stop()


async def told(
    probe: VllmPriorityProbe, engine: vllm.VllmProcess, policy: str
) -> PriorityOutcome | None:
    """What the probe tells within the tries the worker gives it: one that cannot tell (a
    busy machine, the slots not all held) is tried again, as the worker does; one that tells
    must tell right the first time it does."""
    outcome = None
    for _ in range(PRIORITY_TRIES):
        # The fillers of a try before were ended: the engine is soon idle again.
        await eventually(lambda: _idle(engine), timeout_s=10, interval_s=0.2)
        outcome = await probe.check()
        # What the probe measured, for the record (pytest -s, or -o log_cli=true).
        print(f"\n{policy}: {outcome} {probe.unknown_reason or ''} {probe.timings}")
        if outcome is not None:
            break
    return outcome
