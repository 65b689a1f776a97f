"""The New batch view estimates the batch a chosen file would make (POST /v1/batches/estimate)
before it is created: its worst case, its expected cost with the answers it was measured on,
whether it would be accepted, and when it would finish; the creation then reserves the worst
case shown."""

from __future__ import annotations

import re
from typing import Any

import pytest

from backfill.domain.money import usd_to_pico
from tests.browser.conftest import Site
from tests.browser.playwright_api import FilePayload, Page, expect
from tests.support import chat_line, jsonl, until

pytestmark = pytest.mark.browser


def rows(prefix: str, n: int) -> bytes:
    """Answers of 3 tokens each, from lines that allow 48, each taking 3 s: two run at a time,
    so a batch of them is still running when its page first shows."""
    return jsonl(
        [
            chat_line(f"{prefix}{i}", f"[[sim:tokens=3]] [[sim:delay_ms=3000]] q{i}", max_tokens=48)
            for i in range(n)
        ]
    )


def payload(content: bytes) -> FilePayload:
    return {"name": "requests.jsonl", "mimeType": "application/jsonl", "buffer": content}


def api_estimate(site: Site, content: bytes, window: str = "24h") -> tuple[int, dict[str, Any]]:
    """The API's own answer for a file of ``content``: its status and body."""
    with site.api() as client:
        uploaded = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("same.jsonl", content, "application/jsonl")},
        )
        assert uploaded.status_code == 200, uploaded.text
        found = client.post(
            "/v1/batches/estimate",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": window,
            },
        )
    answer: dict[str, Any] = found.json()
    return found.status_code, answer


def new_batch(page: Page, site: Site) -> None:
    page.goto(site.url)
    page.fill("#secret", site.write_key)
    page.press("#secret", "Enter")
    expect(page.locator("#view h1")).to_have_text("Batches")
    page.click("nav >> text=New batch")
    expect(page.locator("#view h1")).to_have_text("New batch")


def test_the_estimate_shows_before_create_and_the_batch_reserves_it(page: Page, site: Site) -> None:
    content = rows("a", 4)
    status, expected = api_estimate(site, content)
    assert status == 200, expected
    new_batch(page, site)
    expect(page.locator("#estimate")).to_be_hidden()

    page.set_input_files("#file", files=[payload(content)])
    estimate = page.locator("#estimate")
    expect(estimate.locator("h2")).to_have_text("Estimate for 4 requests")
    expect(estimate.locator("[data-estimate=worst-case]")).to_contain_text(
        f"${expected['worst_case']['cost']}"
    )
    expect(estimate.locator("[data-estimate=expected]")).to_contain_text(
        f"${expected['expected']['cost']}"
    )
    expect(estimate.locator("[data-estimate=sample]")).to_contain_text(
        "no answer of sim-model measured yet: each line at its max_tokens"
    )
    available = expected["admission"]["available_credit"]
    expect(estimate.locator("[data-admitted=true]")).to_have_text(
        f"Would be accepted now (${available} available)"
    )
    expect(estimate.locator("[data-estimate=completion]")).to_contain_text(
        "Unknown: the model's rate is not measured yet"
    )
    # The estimate comes before the button that creates the batch.
    assert page.evaluate(
        "Boolean(document.getElementById('estimate').compareDocumentPosition("
        "document.getElementById('create')) & Node.DOCUMENT_POSITION_FOLLOWING)"
    )
    site.screenshot(page, "new-batch-estimate.png")

    # A window the server refuses: the API's message, as creation would answer it.
    status, refused = api_estimate(site, content, "1h")
    assert status == 400, refused
    page.fill("#window", "1h")
    page.press("#window", "Tab")
    expect(estimate.locator(".api-error .message")).to_have_text(refused["error"]["message"])
    expect(estimate.locator("[data-field=field]")).to_have_text("completion_window")

    page.fill("#window", "24h")
    page.press("#window", "Tab")
    expect(estimate.locator("[data-admitted=true]")).to_be_visible()
    page.click("#create")
    expect(page.locator("#view h1.batch-id")).to_have_text(re.compile(r"^batch_"))
    batch_id = page.locator("#view h1.batch-id").inner_text()
    with site.api() as client:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        # Made from the file the estimate uploaded, and holding the worst case it showed: each
        # answer's charge comes out of the reservation while the batch runs.
        assert batch["request_counts"]["total"] == 4
        assert batch["status"] == "in_progress", batch
        held = usd_to_pico(batch["cost"]["reserved"]) + usd_to_pico(batch["cost"]["charged"])
        assert held == usd_to_pico(expected["worst_case"]["cost"])
        until(
            "the batch to complete",
            lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed",
        )

    # Its answers are measured now: the next estimate prices them.
    page.click("nav >> text=New batch")
    page.set_input_files("#file", files=[payload(rows("b", 2))])
    expect(page.locator("#estimate [data-estimate=sample]")).to_contain_text(
        "3 output tokens per request, measured over your last 4 answers of sim-model"
    )
