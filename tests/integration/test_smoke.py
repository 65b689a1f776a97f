"""The whole lifecycle in one process against the simulated engine."""

from __future__ import annotations

from tests.support import InProcess, chat_line, jsonl


async def test_batch_completes_with_one_row_per_custom_id(backfill: InProcess) -> None:
    rows = [chat_line(f"req-{i}", f"question {i}") for i in range(50)]
    batch = await backfill.run_batch(rows)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 50, "completed": 50, "failed": 0}
    out = await backfill.rows(batch["output_file_id"])
    errors = await backfill.rows(batch["error_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(50))
    assert errors == []
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert out[0]["response"]["body"]["model"] == "sim-model"


async def test_create_with_a_non_string_endpoint_is_a_400(backfill: InProcess) -> None:
    uploaded = (await backfill.upload(jsonl([chat_line("a")]))).json()
    response = await backfill.client.post(
        "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": [["x"]], "completion_window": "24h"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "endpoint"
