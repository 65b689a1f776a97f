"""The CLI at the edge: server messages are printed as text, and a weak admin token stops the
service before it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backfill.settings import MIN_ADMIN_TOKEN_CHARS
from tests.support import ServerProcess, chat_line, jsonl


def test_batch_run_prints_bracketed_server_messages_as_text(
    server_process: ServerProcess, tmp_path: Path
) -> None:
    source = tmp_path / "requests.jsonl"
    # Rich markup would read "[/x]" as a closing tag and crash instead of printing the error.
    source.write_bytes(jsonl([chat_line("[/x]"), chat_line("[/x]"), chat_line("[bold]b")]))
    env = dict(
        os.environ,
        BACKFILL_API_KEY=server_process.key,
        BACKFILL_BASE_URL=server_process.base_url,
        COLUMNS="200",
    )
    cli = subprocess.run(
        [sys.executable, "-m", "backfill.cli", "batch", "run", str(source)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "MarkupError" not in cli.stderr
    assert "Error: POST /files failed (400)" in cli.stderr
    assert "[/x]" in cli.stderr


def test_short_admin_token_refuses_to_start(tmp_path: Path) -> None:
    env = dict(os.environ, BACKFILL_ADMIN_TOKEN="too-short")
    env.pop("BACKFILL_CONFIG", None)
    for command in (
        ["up", "--no-local-engine", "--data", str(tmp_path / "data"), "--port", "1"],
        ["serve", "--port", "1"],
    ):
        cli = subprocess.run(
            [sys.executable, "-m", "backfill.cli", *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert cli.returncode == 2, cli.stdout + cli.stderr
        assert f"at least {MIN_ADMIN_TOKEN_CHARS}" in cli.stderr
        assert "Traceback" not in cli.stderr
    assert not (tmp_path / "data").exists()
