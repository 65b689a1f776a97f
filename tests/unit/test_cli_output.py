"""What the CLI prints for people: whole batch ids in ``batch list``, and the block ``backfill
up`` prints once it answers."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from backfill.cli.banner import ready_banner, site
from backfill.cli.batch import (
    DEFAULT_BASE_URL,
    _age,
    _listing,
    _status_line,
    _summary,
    base_url_for,
)

NOW = 1_800_000_000.0


def a_batch(batch_id: str, status: str = "in_progress", **fields: Any) -> dict[str, Any]:
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "status": status,
        "created_at": int(NOW) - 3 * 3600,
        "request_counts": {"total": 100_000, "completed": 12_345, "failed": 1_234},
        "usage": {"input_tokens": 5000, "output_tokens": 700, "total_tokens": 5700},
        **fields,
    }


def rendered(table: Any, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 100])
def test_batch_list_shows_ids_whole_at_any_width(width: int) -> None:
    ids = [f"batch_{i:024x}" for i in range(3)]
    text = rendered(_listing([a_batch(i) for i in ids], NOW), width)
    for batch_id in ids:
        assert batch_id in text


@pytest.mark.parametrize("width", [80, 100])
def test_batch_list_fits_a_terminal_without_cutting_anything(width: int) -> None:
    text = rendered(_listing([a_batch("batch_" + "a" * 24, "in_progress")], NOW), width)
    assert "…" not in text
    assert "in_progress" in text
    assert "13,579/100,000" in text
    assert "1,234" in text
    assert "3h" in text
    assert max(len(line) for line in text.splitlines()) <= width


def test_an_empty_listing_renders() -> None:
    assert "id" in rendered(_listing([], NOW), 80)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-2, "0s"), (5, "5s"), (59, "59s"), (60, "1m"), (7200, "2h"), (86_400 * 3, "3d")],
)
def test_age_in_its_largest_unit(seconds: float, text: str) -> None:
    assert _age(seconds) == text


def test_batch_status_summary_keeps_ids_whole() -> None:
    text = rendered(
        _summary(a_batch("batch_" + "b" * 24, "completed", output_file_id="file-" + "c" * 24)), 60
    )
    assert "batch_" + "b" * 24 in text
    assert "file-" + "c" * 24 in text
    assert "13,579/100,000 done, 1,234 failed" in text
    assert "5,000 in, 700 out" in text


def test_batch_status_says_why_a_batch_waits_and_when_it_moves_again() -> None:
    message = (
        "Engine 'vllm' serving model 'm' answered Backfill with 429 Too Many Requests since "
        "2027-01-15 08:00:00 UTC: the engine is limiting the requests it takes."
    )
    waiting = {
        "code": "rate_limited",
        "since": int(NOW),
        "resumes_at": int(NOW) + 30,
        "message": message,
    }
    text = rendered(_summary(a_batch("batch_w", waiting_on=waiting)), 100)
    assert "rate_limited since " in text
    assert "expected to move about " in text
    assert "Too Many Requests" in text
    assert _status_line(a_batch("batch_w", waiting_on=waiting)) == (
        "in_progress (waiting: rate_limited)"
    )
    # A batch that moves shows neither.
    moving = a_batch("batch_m", waiting_on=None)
    assert "waiting" not in rendered(_summary(moving), 100)
    assert _status_line(moving) == "in_progress"


def test_the_first_start_shows_the_key_and_what_to_run_next() -> None:
    text = ready_banner(
        root="http://127.0.0.1:8080",
        data_dir=Path("backfill-data"),
        key="bf-abc",
        program="backfill",
    )
    assert "Backfill is ready at http://127.0.0.1:8080/v1" in text
    assert "bf-abc" in text
    assert "shown only on this first start" in text
    assert "export OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=bf-abc" in text
    assert "backfill batch run" in text
    assert "Batches page:  http://127.0.0.1:8080/" in text


def test_a_later_start_shows_no_key_but_how_to_make_one() -> None:
    text = ready_banner(
        root="http://127.0.0.1:9000", data_dir=Path("d"), key=None, program=".venv/bin/backfill"
    )
    assert "shown only on this first start" not in text
    assert "OPENAI_API_KEY=bf-..." in text
    assert ".venv/bin/backfill admin key create --org default --data d" in text


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8080"),
        ("0.0.0.0", "http://127.0.0.1:8080"),
        ("::", "http://[::1]:8080"),
        ("::1", "http://[::1]:8080"),
        ("backfill.internal", "http://backfill.internal:8080"),
    ],
)
def test_the_address_shown_is_one_a_browser_reaches(host: str, url: str) -> None:
    assert site(host, 8080) == url


def test_openai_base_url_is_followed_only_with_its_own_key() -> None:
    url = "https://gateway.example/v1"
    pair = {"OPENAI_BASE_URL": url, "OPENAI_API_KEY": "sk-1"}
    assert base_url_for(None, "sk-1", pair) == url
    # A Backfill key is not sent where the OpenAI variables point.
    assert base_url_for(None, "bf-2", pair | {"BACKFILL_API_KEY": "bf-2"}) == DEFAULT_BASE_URL
    assert base_url_for(None, "bf-2", {"OPENAI_BASE_URL": url}) == DEFAULT_BASE_URL
    # An address given (option or BACKFILL_BASE_URL) wins, even one equal to the default.
    assert base_url_for(DEFAULT_BASE_URL, "sk-1", pair) == DEFAULT_BASE_URL
    assert base_url_for("http://other/v1", "sk-1", pair) == "http://other/v1"
