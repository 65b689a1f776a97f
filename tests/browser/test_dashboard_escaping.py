"""Markup in what the API returns is shown as text, never run or parsed: batch metadata, a
custom_id, a credit's note, an upload's error message, every field of an engine; and a
malformed address shows the not-found view. A dialog, a script error or a console error
(a refused inline handler included) fails the test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.conftest import Site
from tests.browser.playwright_api import FilePayload, Page, Route, expect
from tests.support import chat_line, jsonl, submit

pytestmark = pytest.mark.browser

# Each would run script if it were inserted as markup: an alert (a dialog) or a handler the
# Content-Security-Policy refuses (a console error).
IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(2)</script>"
SVG = '<svg onload="alert(3)"><b>bold</b></svg>'
# Elements that only inserted markup could make: the page itself makes none of them.
INJECTED = "#view img, #view script, #view b, #view svg:not(.chart)"


@pytest.fixture
def guarded(page: Page) -> Iterator[Page]:
    """``page``, failing the test on any dialog (``alert`` from injected markup)."""
    dialogs: list[str] = []

    def on_dialog(dialog: Any) -> None:
        dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    yield page
    assert not dialogs, dialogs


def signed_in(page: Page, site: Site, secret: str | None = None) -> None:
    page.goto(site.url)
    page.fill("#secret", secret or site.write_key)
    page.press("#secret", "Enter")
    expect(page.locator("#view h1")).not_to_have_text("")


def no_markup_ran(page: Page) -> None:
    assert page.locator(INJECTED).count() == 0, page.locator("#view").inner_html()


def test_batch_metadata_custom_ids_and_notes_are_text(guarded: Page, site: Site) -> None:
    page = guarded
    metadata = {"description": IMG, "note": SCRIPT, "<b>key</b>": SVG}
    with site.api() as client:
        batch_id = submit(client, [chat_line(IMG), chat_line(SCRIPT)], metadata=metadata)
    with site.api(site.admin_token) as admin:
        credited = admin.post(
            "/admin/v1/credits", json={"org": "default", "usd": "1", "note": SVG + IMG}
        )
        assert credited.status_code == 200, credited.text

    signed_in(page, site)
    expect(page.locator(f"tr[data-batch='{batch_id}']")).to_be_visible()
    no_markup_ran(page)

    page.goto(f"{site.url}#/batch/{batch_id}")
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=30_000)
    details = page.locator("#view dl.pairs")
    for key, value in metadata.items():
        expect(details.locator("dt", has_text=key)).to_have_count(1)
        expect(details.locator("dd").filter(has_text=value).first).to_have_text(value)
    page.click("#show-results")
    summaries = page.locator("ol.results summary")
    expect(summaries).to_have_count(2)
    assert sorted(s.split(" — ")[0] for s in summaries.all_inner_texts()) == sorted([IMG, SCRIPT])
    no_markup_ran(page)

    page.goto(f"{site.url}#/account")
    expect(page.locator("tr[data-entry]").first).to_be_visible()
    expect(page.locator("tr[data-entry]").filter(has_text=SVG + IMG)).to_have_count(1)
    no_markup_ran(page)


def test_an_upload_error_that_echoes_markup_shows_it_as_text(guarded: Page, site: Site) -> None:
    page = guarded
    line = chat_line("x")
    line["method"] = IMG
    bad = jsonl([line])
    with site.api() as client:
        refused = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("bad.jsonl", bad, "application/jsonl")},
        )
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert IMG in message  # the API echoes the value: the page must not parse it

    signed_in(page, site)
    page.goto(f"{site.url}#/new")
    upload: FilePayload = {"name": "bad.jsonl", "mimeType": "application/jsonl", "buffer": bad}
    page.set_input_files("#file", files=[upload])
    page.click("#create")
    expect(page.locator("#create-message .api-error .message")).to_have_text(message)
    no_markup_ran(page)


def hostile_engine(worker: str) -> dict[str, Any]:
    """An engine object of docs/api.md with markup in every string field."""
    return {
        "id": f"{IMG}engine",
        "object": "engine",
        "worker": f"{SCRIPT}{worker}",
        "url": f"http://127.0.0.1:9/v1/{IMG}",
        "models": [SVG, "sim-model"],
        "healthy": False,
        "state": "down",
        "last_error": f"cannot connect: {IMG} {SCRIPT}",
        "checked_at": 1714564810,
        "healthy_since": None,
        "down_since": 1714564804,
        "in_flight": 3,
        "max_concurrency": 64,
        "mode": "shared",
        "concurrency_limit": 23,
        "signal": "metrics",
        "pressure": 37.0,
        "added_later": SVG,
    }


def test_engine_fields_with_markup_are_text(guarded: Page, site: Site) -> None:
    page = guarded

    # A real engine reports plain errors, so the answer is the real list plus one engine
    # whose every string holds markup.
    def with_hostile_engine(route: Route) -> None:
        real = route.fetch()
        body = real.json()
        if real.ok:
            body["data"].append(hostile_engine(body["data"][0]["worker"]))
        route.fulfill(response=real, json=body)

    page.route("**/admin/v1/engines", with_hostile_engine)
    signed_in(page, site, site.admin_token)
    expect(page.locator("#view h1")).to_have_text("Operations")
    row = page.locator("#engines tr").filter(has_text=f"{IMG}engine")
    expect(row).to_have_count(1)
    cell = row.locator("td[data-label='Last error']")
    expect(cell).to_have_text(f"cannot connect: {IMG} {SCRIPT}")
    expect(row.locator("td[data-label='Engine']")).to_contain_text(f"{SCRIPT}")
    expect(row.locator("td[data-label='Engine']")).to_contain_text(f"http://127.0.0.1:9/v1/{IMG}")
    expect(row.locator("td[data-label='Health']")).to_contain_text("unhealthy")
    expect(row.locator("td[data-label='In flight']")).to_have_text("3")
    expect(row.locator("td[data-label='Limit']")).to_have_text("23 of 64")
    expect(row.locator("td[data-label='Models']")).to_have_text(f"{SVG}, sim-model")
    expect(row.locator("td[data-label='More']")).to_contain_text(f"added_later: {SVG}")
    # The real engine, as the API sends it: healthy, no error.
    real = page.locator("#engines tr[data-engine=sim]")
    expect(real.locator("td[data-label='Health']")).to_contain_text("healthy")
    expect(real.locator("td[data-label='Last error']")).to_have_text("—")
    no_markup_ran(page)


@pytest.mark.parametrize("fragment", ["#/batch/%E0%A", "#/batch/%", "#/batch/%ZZ<b>x</b>"])
def test_a_malformed_address_shows_not_found(guarded: Page, site: Site, fragment: str) -> None:
    page = guarded
    signed_in(page, site)
    expect(page.locator("#view h1")).to_have_text("Batches")
    page.goto(site.url + fragment)
    expect(page.locator("#view h1")).to_have_text("Not found")
    # The address as the browser keeps it, shown as text.
    expect(page.locator("#view")).to_contain_text("/batch/%")
    expect(page.locator("#view a[href='#/batches']")).to_be_visible()
    no_markup_ran(page)
    # A good address afterwards works as before.
    page.goto(site.url + "#/batches")
    expect(page.locator("#view h1")).to_have_text("Batches")
