"""/readyz and Prometheus /metrics (SPEC §11.5): counts and timings, never content."""

from __future__ import annotations

import re

import pytest

from tests.support import InProcess, chat_line


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} not in metrics:\n{text}"
    return float(match.group(1))


async def test_readyz_answers_ready_while_the_database_answers(backfill: InProcess) -> None:
    response = await backfill.client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready"}


async def test_readyz_is_503_when_the_database_is_down(
    backfill: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable() -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(backfill.backfill.store, "ping", unreachable)
    response = await backfill.client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["status"] == "not ready"


async def test_metrics_count_results_retries_and_batches_without_content(
    backfill: InProcess,
) -> None:
    canary = "canary-7f3e-not-for-metrics"
    rows = [chat_line(f"ok-{i}", f"{canary} {i}") for i in range(5)]
    rows.append(chat_line("flaky", f"{canary} [[sim:fail_first=1]]"))
    rows.append(chat_line("bad", f"{canary} [[sim:status=400]]"))
    batch = await backfill.run_batch(rows)
    assert batch["status"] == "completed"

    response = await backfill.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert _value(text, 'backfill_results_total{outcome="ok"}') == 6
    assert _value(text, 'backfill_results_total{outcome="error"}') == 1
    assert _value(text, 'backfill_engine_retries_total{engine="sim",reason="503"}') == 1
    assert _value(text, 'backfill_batches{status="completed"}') == 1
    assert _value(text, "backfill_queue_depth") == 0
    assert _value(text, 'backfill_engine_in_flight{engine="sim"}') == 0
    assert _value(text, 'backfill_engine_latency_seconds_count{engine="sim"}') == 8
    usage = batch["usage"]
    assert _value(text, 'backfill_tokens_total{kind="input"}') == usage["input_tokens"]
    assert _value(text, 'backfill_tokens_total{kind="output"}') == usage["output_tokens"]
    assert canary not in text
    assert "ok-1" not in text, "custom_ids are content too"
