"""The New batch form's "Check answers against each line's response_format schema" box creates
the batch with ``output_validation``: an answer off its line's schema ends as an error row
``output_schema_mismatch``; left unticked, the batch's answers are not checked."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.browser.conftest import Site
from tests.browser.playwright_api import FilePayload, Page, expect
from tests.support import chat_line, jsonl, until

pytestmark = pytest.mark.browser

FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "n",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
}
BOX = "#output-validation"


def payload() -> FilePayload:
    rows = [
        chat_line("fits", "[[sim:tokens=3]] a number", max_tokens=48, response_format=FORMAT),
        chat_line("off", "[[sim:off_schema]] [[sim:tokens=3]] a number", max_tokens=48,
                  response_format=FORMAT),
    ]  # fmt: skip
    return {"name": "numbers.jsonl", "mimeType": "application/jsonl", "buffer": jsonl(rows)}


def create(page: Page, site: Site, *, tick: bool) -> dict[str, Any]:
    """Create a batch of ``payload`` from the New batch form; the batch once it ended."""
    page.goto(site.url)
    page.fill("#secret", site.write_key)
    page.press("#secret", "Enter")
    page.click("nav >> text=New batch")
    expect(page.locator("#view h1")).to_have_text("New batch")
    box = page.locator(BOX)
    expect(box).not_to_be_checked()
    expect(page.locator(f"label[for={BOX[1:]}]")).to_contain_text(
        "Check answers against each line's response_format schema"
    )
    page.set_input_files("#file", files=[payload()])
    if tick:
        box.check()
    page.click("#create")
    expect(page.locator("#view h1.batch-id")).to_have_text(re.compile(r"^batch_"))
    batch_id = page.locator("#view h1.batch-id").inner_text()
    with site.api() as client:
        until(
            f"batch {batch_id} completed",
            lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed",
            timeout_s=60,
        )
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
    return batch


def error_codes(site: Site, batch: dict[str, Any]) -> list[tuple[str, str]]:
    with site.api() as client:
        response = client.get(f"/v1/files/{batch['error_file_id']}/content")
    assert response.status_code == 200, response.text
    rows = [json.loads(line) for line in response.text.splitlines()]
    return [(row["custom_id"], row["error"]["code"]) for row in rows]


def test_the_box_checks_each_answer_against_its_schema(page: Page, site: Site) -> None:
    batch = create(page, site, tick=True)
    assert batch["output_validation"] is True
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert error_codes(site, batch) == [("off", "output_schema_mismatch")]


def test_left_unticked_the_answers_are_not_checked(page: Page, site: Site) -> None:
    batch = create(page, site, tick=False)
    assert batch["output_validation"] is False
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
