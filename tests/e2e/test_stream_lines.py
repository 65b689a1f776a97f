"""``stream: true`` in a batch line where the operator set ``limits.ignore_stream``, as a user
of the OpenAI SDK meets it against a real ``backfill up`` and the simulator process: the file
some hosted batch services accept runs unchanged, and each result is the whole answer. The
simulator, like vLLM, refuses ``stream_options`` without ``stream`` and streams when asked: a
line whose fields reached it would fail or arrive as server-sent events."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support import (
    SimulatorProcess,
    chat_line,
    jsonl,
    sdk_wait_terminal,
    serve_config,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_stream_true_lines_drain_whole_where_it_is_ignored(
    tmp_path: Path, sim_process: SimulatorProcess
) -> None:
    config = tmp_path / "backfill.toml"
    write_sim_config(config, sim_process.base_url, extra="limits.ignore_stream = true")
    server = serve_config(tmp_path, config)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key=server.key, max_retries=0)
        lines = [
            chat_line(f"s{n}", stream=True, stream_options={"include_usage": True})
            for n in range(4)
        ]
        lines += [chat_line("plain"), chat_line("s-false", stream=False)]
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = sdk_wait_terminal(client, batch)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
        assert batch.output_file_id is not None
        rows = [json.loads(r) for r in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in rows) == sorted(line["custom_id"] for line in lines)
        for row in rows:
            body = row["response"]["body"]
            assert row["response"]["status_code"] == 200, row
            assert body["object"] == "chat.completion", row
            assert body["usage"]["completion_tokens"] > 0, row

        # stream_options alone is still refused, naming its line: no engine takes it.
        wrong = jsonl([chat_line("ok"), chat_line("alone", stream_options={"include_usage": True})])
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("bad.jsonl", wrong), purpose="batch")
        error = refused.value.body
        assert isinstance(error, dict)
        assert error["code"] == "unsupported_parameter"
        assert error["line"] == 2
        assert error["param"] == "body.stream_options"
    finally:
        server.stop()
