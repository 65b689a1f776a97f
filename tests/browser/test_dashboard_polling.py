"""What the batches list asks of the server while batches run: the visible page again (one
list call) and one charges call per refresh, never one call per batch; nothing once every
visible batch has ended."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.browser.conftest import Site
from tests.browser.playwright_api import Page, Request, expect
from tests.support import chat_line, submit

pytestmark = pytest.mark.browser

SLOW = "[[sim:delay_ms=1000]]"
ONE_BATCH = re.compile(r"^/v1/batches/[^/]+$")
ENDED = re.compile(r"^(cancelled|completed)$")


def test_the_list_refreshes_its_page_with_one_call(page: Page, site: Site) -> None:
    with site.api() as client:
        running = [
            submit(client, [chat_line(f"p{n}-{i}", f"{SLOW} {i}") for i in range(20)])
            for n in range(2)
        ]
    calls: list[tuple[str, dict[str, list[str]]]] = []

    def record(request: Request) -> None:
        url = urlsplit(request.url)
        if url.path.startswith("/v1/"):
            calls.append((url.path, parse_qs(url.query)))

    page.on("request", record)
    page.goto(site.url)
    page.fill("#secret", site.write_key)
    page.press("#secret", "Enter")
    expect(page.locator("#view h1")).to_have_text("Batches")
    rows = [page.locator(f"tr[data-batch='{batch_id}']") for batch_id in running]
    for row in rows:
        expect(row).to_be_visible()
    # Counts move without a reload: the refresh works.
    for row in rows:
        expect(row.locator("[data-count=completed]")).not_to_have_text("0", timeout=30_000)

    lists = [query for path, query in calls if path == "/v1/batches"]
    charges = [query for path, query in calls if path == "/v1/organization/batch_charges"]
    assert not [path for path, _ in calls if ONE_BATCH.match(path)], calls
    assert len(lists) >= 2, calls
    # The same page each time: the first page, as shown.
    assert all("after" not in query for query in lists), lists
    # Each list call is followed by one charges call (the last may not have gone out yet).
    assert len(lists) - 1 <= len(charges) <= len(lists), calls
    for query in charges:
        assert set(running) <= set(query["ids"][0].split(",")), query

    # Once every batch on the page has ended, the page stops asking.
    with site.api() as client:
        for batch_id in running:
            client.post(f"/v1/batches/{batch_id}/cancel")
    for row in rows:
        # Cancelled, or completed if its last lines finished first.
        expect(row).to_have_attribute("data-status", ENDED, timeout=30_000)
    asked = len(calls)
    page.wait_for_timeout(5_000)
    assert calls[asked:] == [], calls[asked:]
