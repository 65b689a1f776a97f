"""A model alias as a user of the OpenAI SDK meets it, against a real ``backfill up`` and the
simulator process: code written for ``gpt-4o-mini`` runs unchanged on the catalog model the
operator aliased, the batch shows that model, and each row's ``response.body.model`` is the
engine's answer (its served name), not the alias."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support import (
    SIM_MODEL,
    SimulatorProcess,
    chat_line,
    jsonl,
    sdk_wait_terminal,
    serve_config,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ALIAS = "gpt-4o-mini"
# What the engine calls the simulated model; the simulator answers under the name it is sent.
SERVED = "sim-served"


def test_an_alias_line_drains_through_the_sdk(
    tmp_path: Path, sim_process: SimulatorProcess
) -> None:
    engines = f"""
[[engines]]
name = "sim"
base_url = "{sim_process.base_url}"
models = ["{SIM_MODEL}"]
served_names = {{ "{SIM_MODEL}" = "{SERVED}" }}
max_concurrency = 8
request_timeout_s = 5.0
"""
    config = tmp_path / "backfill.toml"
    write_sim_config(config, sim_process.base_url, engines=engines, aliases=[ALIAS, "sim-7b"])
    server = serve_config(tmp_path, config)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key=server.key, max_retries=0)
        # An OpenAI-compatible client may look the name up first.
        assert client.models.retrieve(ALIAS).id == SIM_MODEL
        listed = {m.id: m for m in client.models.list()}
        assert ALIAS not in listed
        assert listed[SIM_MODEL].model_dump()["aliases"] == [ALIAS, "sim-7b"]

        lines = [chat_line(f"alias-{n}", f"question {n}", model=ALIAS) for n in range(5)]
        lines += [chat_line("by-id", model=SIM_MODEL), chat_line("other-alias", model="sim-7b")]
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.model == SIM_MODEL
        batch = sdk_wait_terminal(client, batch)
        assert batch.status == "completed", batch
        assert batch.model == SIM_MODEL
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (7, 0)
        assert batch.output_file_id is not None
        text = client.files.content(batch.output_file_id).text
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == 7
        assert {r["response"]["body"]["model"] for r in rows} == {SERVED}
        assert all(r["response"]["status_code"] == 200 for r in rows)

        # A name that is no model's, in any case, is refused with its line.
        wrong = jsonl([chat_line("typo", model="GPT-4o-mini")])
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("bad.jsonl", wrong), purpose="batch")
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["code"] == "model_not_found"
        assert refused.value.body["line"] == 1
        assert refused.value.body["param"] == "body.model"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("GPT-4o-mini")
    finally:
        server.stop()
