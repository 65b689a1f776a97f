"""Every line the upload accepts can be sent (SPEC §5: validated whole before the reply).

Body fields are forwarded as the user wrote them, so numbers beyond 64 bits, ``1e400`` and deep
nesting reach the engine byte for byte and the engine's own answer decides the row; no line
fails inside Backfill because an encoder refuses it.
"""

from __future__ import annotations

from backfill.simulator.server import Simulator
from tests.support import InProcess, chat_line, jsonl


def _line(custom_id: str, field: str) -> bytes:
    base = jsonl([chat_line(custom_id)])
    return base.replace(b'"max_tokens":16', b'"max_tokens":16,"extra":' + field.encode())


async def test_lines_no_encoder_could_rebuild_still_run(
    backfill: InProcess, sim: tuple[str, Simulator]
) -> None:
    content = b"".join(
        [
            _line("big-int", "1180591620717411303424"),
            _line("nested", "[" * 300 + "]" * 300),
            _line("overflow", "1e400"),
            jsonl([chat_line("plain")]),
        ]
    )
    uploaded = await backfill.upload(content)
    assert uploaded.status_code == 200, uploaded.text
    created = await backfill.create(uploaded.json()["id"])
    assert created.status_code == 200, created.text
    batch = await backfill.wait(created.json()["id"])

    assert batch["status"] == "completed"
    ok = {r["custom_id"] for r in await backfill.rows(batch["output_file_id"])}
    errors = {r["custom_id"]: r for r in await backfill.rows(batch["error_file_id"])}
    assert ok == {"big-int", "nested", "plain"}
    # The simulator's JSON parser refuses 1e400: that is the engine's answer, kept as it gave it.
    assert set(errors) == {"overflow"}
    assert errors["overflow"]["error"] is None
    assert errors["overflow"]["response"]["status_code"] == 400
