"""Structured outputs held in batch (``output_validation``), against a real ``backfill up``:
the simulator made to answer off-schema, and the bundled llama.cpp engine, whose grammar keeps
every answer to its line's JSON Schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from backfill.domain.money import Prices, token_charge
from tests.support import (
    SIM_PRICES,
    ServerProcess,
    batch_cli,
    batch_of,
    chat_line,
    ended,
    jsonl,
    rows_of,
    submit,
)

LOCAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TICKET = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative"]},
        "urgent": {"type": "boolean"},
    },
    "required": ["sentiment", "urgent"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET}}
# The simulated model's batch prices (SIM_PRICES), as the receipts apply them.
PRICES = Prices(SIM_PRICES.input, SIM_PRICES.cached_input or 0, SIM_PRICES.output)


def ticket_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    # 64 output tokens (the simulator's default) stay under the limit: the answer is whole.
    body = {"max_tokens": 100, "response_format": FORMAT, **body}
    return chat_line(custom_id, content, **body)


def batch_run(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return batch_cli(server, "run", *args, timeout_s=180)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_off_their_schema_fail_are_charged_and_rerun_alone(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    rows = [ticket_line(f"ok-{i}", f"ticket {i}: the app is great") for i in range(3)]
    mismatched = {
        # JSON of the wrong type, prose, and JSON cut off at the output limit.
        "off": ticket_line("off", "[[sim:off_schema]] ticket: it crashes"),
        "prose": ticket_line("prose", "[[sim:not_json]] ticket: it is slow"),
        "cut": ticket_line("cut", "[[sim:tokens=40]] ticket: cut", max_tokens=8),
    }
    rows += list(mismatched.values())
    # A line that asks for no format is not checked, whatever its answer.
    rows.append(chat_line("plain", "[[sim:not_json]] no format asked"))
    source = tmp_path / "tickets.jsonl"
    source.write_bytes(jsonl(rows))

    # The CLI creates the batch with output_validation and writes the three files.
    done = batch_run(server_process, str(source), "--output-validation")
    assert done.returncode == 0, done.stdout + done.stderr
    results = read_jsonl(tmp_path / "results.jsonl")
    errors = read_jsonl(tmp_path / "errors.jsonl")
    retry = read_jsonl(tmp_path / "tickets.jsonl.retry.jsonl")
    assert sorted(r["custom_id"] for r in results) == ["ok-0", "ok-1", "ok-2", "plain"]
    assert sorted(r["custom_id"] for r in errors) == sorted(mismatched)
    assert sorted(r["custom_id"] for r in retry) == sorted(mismatched)
    batch_id = json.loads((tmp_path / "tickets.jsonl.backfill.json").read_text())["batch_id"]

    validator = Draft202012Validator(TICKET)
    for row in results:
        if row["custom_id"] != "plain":
            content = row["response"]["body"]["choices"][0]["message"]["content"]
            assert validator.is_valid(json.loads(content)), content
    by_id = {row["custom_id"]: row for row in errors}
    for row in errors:
        assert row["error"]["code"] == "output_schema_mismatch", row
        # The engine's answer is kept, under the request id of its receipt.
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["object"] == "chat.completion"
        assert row["response"]["request_id"].startswith("req_")
    reasons = {cid: row["error"]["message"] for cid, row in by_id.items()}
    assert "does not match the schema at $: " in reasons["off"]
    assert "is not of type 'object'" in reasons["off"]
    assert "choices[0].message.content is not JSON" in reasons["prose"]
    assert "finish_reason 'length'" in reasons["cut"]
    for reason in reasons.values():
        assert reason.startswith(
            "The answer does not match the line's body.response_format (json_schema): "
        )

    with server_process.client() as client:
        batch = batch_of(client, batch_id)
        assert batch["output_validation"] is True
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 7, "completed": 4, "failed": 3}
        codes = client.get(f"/v1/batches/{batch_id}/error_codes").json()
        assert codes["data"] == [{"code": "output_schema_mismatch", "count": 3}]

        # Charged exactly as the engine produced every answer, matching or not.
        charged = 0
        for row in results + errors:
            usage = row["response"]["body"]["usage"]
            receipt = client.get(f"/v1/receipts/{row['response']['request_id']}")
            assert receipt.status_code == 200, receipt.text
            found = receipt.json()
            assert found["custom_id"] == row["custom_id"]
            assert found["usage"]["input_tokens"] == usage["prompt_tokens"]
            assert found["usage"]["output_tokens"] == usage["completion_tokens"]
            amount = token_charge(PRICES, usage["prompt_tokens"], 0, usage["completion_tokens"])
            assert int(found["amount"]["value"]) == amount
            charged += amount
        assert batch["usage"]["output_tokens"] == sum(
            r["response"]["body"]["usage"]["completion_tokens"] for r in results + errors
        )
        charges = client.get("/v1/organization/batch_charges", params={"ids": batch_id}).json()
        assert [int(c["charged"]["value"]) for c in charges["data"]] == [charged]

        # Rerunning the failed lines reruns exactly those, checked again.
        rerun = client.post(f"/v1/batches/{batch_id}/retry", json={})
        assert rerun.status_code == 200, rerun.text
        created = rerun.json()
        assert created["output_validation"] is True
        assert created["request_counts"]["total"] == 3
        rerun_input = client.get(f"/v1/files/{created['input_file_id']}/content")
        assert rerun_input.content == jsonl([r for r in rows if r["custom_id"] in mismatched])
        again = ended(client, created["id"])
        assert again["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
        again_codes = {r["error"]["code"] for r in rows_of(client, again["error_file_id"])}
        assert again_codes == {"output_schema_mismatch"}

        # Without output_validation the same answers are plain successes.
        unchecked = ended(client, submit(client, rows))
        assert unchecked["output_validation"] is False
        assert unchecked["request_counts"] == {"total": 7, "completed": 7, "failed": 0}


@pytest.mark.llama
def test_the_local_llama_engine_keeps_every_answer_to_its_schema(
    llama_server: ServerProcess,
) -> None:
    tickets = [
        "The app crashes whenever I open settings. Please fix it today!",
        "Love the new dark mode, thanks.",
        "I was charged twice this month.",
    ]
    rows = [
        ticket_line(f"t-{i}", f"Classify this support ticket as JSON: {text}", model=LOCAL_MODEL)
        for i, text in enumerate(tickets)
    ]
    with llama_server.client() as client:
        client.timeout = httpx.Timeout(120)
        batch = ended(client, submit(client, rows, output_validation=True), timeout_s=240)
        results = rows_of(client, batch["output_file_id"])
        errors = rows_of(client, batch["error_file_id"])
    assert errors == [], errors
    assert batch["output_validation"] is True
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    validator = Draft202012Validator(TICKET)
    for row in results:
        choice = row["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        assert validator.is_valid(answer), answer
