"""The New batch form's Priority field: the batch is created with the priority typed, the
estimate shows the API's refusal of one over the organization's cap before anything is
created, and left at 0 the batch has the default."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.browser.conftest import Site
from tests.browser.playwright_api import FilePayload, Page, expect
from tests.support import chat_line, jsonl

pytestmark = pytest.mark.browser

FIELD = "#priority"


def payload() -> FilePayload:
    rows = [chat_line(f"p{i}", f"[[sim:tokens=2]] q{i}", max_tokens=16) for i in range(2)]
    return {"name": "requests.jsonl", "mimeType": "application/jsonl", "buffer": jsonl(rows)}


def new_batch(page: Page, site: Site) -> None:
    page.goto(site.url)
    page.fill("#secret", site.write_key)
    page.press("#secret", "Enter")
    page.click("nav >> text=New batch")
    expect(page.locator("#view h1")).to_have_text("New batch")
    expect(page.locator(f"label[for={FIELD[1:]}]")).to_have_text("Priority")
    expect(page.locator(FIELD)).to_have_value("0")


def created(page: Page, site: Site) -> dict[str, Any]:
    """Click Create; the batch the page went to, as the API shows it."""
    page.click("#create")
    expect(page.locator("#view h1.batch-id")).to_have_text(re.compile(r"^batch_"))
    batch_id = page.locator("#view h1.batch-id").inner_text()
    with site.api() as client:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
    return batch


def test_a_priority_over_the_cap_is_refused_before_create_and_one_within_it_is_kept(
    page: Page, site: Site
) -> None:
    new_batch(page, site)
    page.set_input_files("#file", files=[payload()])
    estimate = page.locator("#estimate")
    expect(estimate.locator("h2")).to_have_text("Estimate for 2 requests")

    # The organization's cap is 10 until an administrator raises it: the API's own message.
    page.fill(FIELD, "11")
    page.press(FIELD, "Tab")
    expect(estimate.locator(".api-error .message")).to_contain_text(
        "may have a priority of at most 10"
    )
    expect(estimate.locator("[data-field=field]")).to_have_text("priority")

    page.fill(FIELD, "7")
    page.press(FIELD, "Tab")
    expect(estimate.locator("h2")).to_have_text("Estimate for 2 requests")
    batch = created(page, site)
    assert batch["priority"] == 7


def test_left_at_zero_the_batch_has_the_default_priority(page: Page, site: Site) -> None:
    new_batch(page, site)
    page.set_input_files("#file", files=[payload()])
    expect(page.locator("#estimate h2")).to_have_text("Estimate for 2 requests")
    assert created(page, site)["priority"] == 0
