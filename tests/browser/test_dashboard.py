"""The Batches page in a real headless chromium against a real ``backfill up``: sign in,
upload and create, progress that moves, cancel, download, read-only and bad keys, sign out,
a 375 px screen, the admin views. Each test saves screenshots (see ``Site.screenshot``)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import Site
from tests.browser.playwright_api import Browser, FilePayload, Page, expect
from tests.support import chat_line, jsonl, submit

pytestmark = pytest.mark.browser

SLOW = "[[sim:delay_ms=1000]]"


def sign_in(page: Page, site: Site, secret: str) -> None:
    page.goto(site.url)
    page.fill("#secret", secret)
    # From the keyboard: Enter in the field submits the form.
    page.press("#secret", "Enter")


def signed_in(page: Page, site: Site, secret: str | None = None) -> None:
    sign_in(page, site, secret or site.write_key)
    expect(page.locator("#view h1")).to_have_text("Batches")


def api_error(site: Site, method: str, path: str, secret: str, **kwargs: Any) -> dict[str, Any]:
    """The error the API itself answers, to compare with what the page shows."""
    with site.api(secret) as client:
        response = client.request(method, path, **kwargs)
    assert response.status_code >= 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def file_payload(content: bytes, name: str = "requests.jsonl") -> FilePayload:
    return {"name": name, "mimeType": "application/jsonl", "buffer": content}


def status_and_done(page: Page) -> tuple[str, int]:
    """The status and the done count of one render: read separately, a poll landing between
    the two reads pairs an older count with a newer status."""
    status, done = page.evaluate(
        "[document.getElementById('batch-status').innerText,"
        " document.getElementById('done-count').innerText]"
    )
    return str(status), int(str(done).replace(",", ""))


def test_sign_in_upload_create_watch_progress_and_download(
    page: Page, site: Site, browser: Browser
) -> None:
    signed_in(page, site)
    page.click("nav >> text=New batch")
    expect(page.locator("#view h1")).to_have_text("New batch")

    # A file with a bad second line: the page shows the API's line and message as sent.
    bad = jsonl([chat_line("ok"), chat_line("too-long", max_tokens=10**6)])
    expected = api_error(
        site,
        "POST",
        "/v1/files",
        site.write_key,
        data={"purpose": "batch"},
        files={"file": ("requests.jsonl", bad, "application/jsonl")},
    )
    page.set_input_files("#file", files=[file_payload(bad)])
    page.click("#create")
    message = page.locator("#create-message .api-error")
    expect(message.locator(".message")).to_have_text(expected["message"])
    expect(message.locator("[data-field=line]")).to_have_text(str(expected["line"]))

    # A good file of slow lines: two run at a time, so the batch takes several seconds.
    rows = [chat_line(f"line-{i}", f"{SLOW} question {i}") for i in range(12)]
    page.set_input_files("#file", files=[file_payload(jsonl(rows))])
    page.fill("#description", "dashboard test")
    page.click("#create")
    expect(page.locator("#view h1.batch-id")).to_have_text(re.compile(r"^batch_"))
    batch_id = page.locator("#view h1.batch-id").inner_text()
    page.evaluate("window.notReloaded = true")
    # The page's first render of the batch (status and counts together).
    expect(page.locator("#done-count")).to_be_visible()

    # Progress moves on the page without a reload, until the batch completes.
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, done = status_and_done(page)
        seen.append(done)
        if status == "completed":
            break
        page.wait_for_timeout(200)
    assert page.locator("#batch-status").inner_text() == "completed"
    assert page.evaluate("window.notReloaded") is True
    assert seen == sorted(seen), seen
    assert any(0 < n < len(rows) for n in seen), seen
    assert seen[-1] == len(rows)
    points = int(page.locator("svg.chart").get_attribute("data-points") or 0)
    assert points >= 4
    expect(page.locator("svg.chart")).to_have_attribute("data-source", "server")
    expect(page.locator(".timeline [data-event=completed_at]")).to_be_visible()
    expect(page.locator("#error-codes")).to_contain_text("No failed requests")
    site.screenshot(page, "batch-page.png")

    # The curve is the server's: a new tab, with no samples of its own, opened after the end
    # draws a point for every stored result.
    with site.api() as client:
        stored = client.get(f"/v1/batches/{batch_id}/progress").json()["points"]
    assert [p["done"] for p in stored] == list(range(1, len(rows) + 1))
    assert_drawn_from_the_server(browser, site, batch_id, len(stored))

    # Download the output file: the bytes are the API's own.
    with site.api() as client:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        expected_bytes = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    assert batch["metadata"] == {"description": "dashboard test"}
    with page.expect_download() as download:
        page.click("#download-output")
    saved = Path(download.value.path())
    assert saved.read_bytes() == expected_bytes
    assert len(expected_bytes.splitlines()) == len(rows)

    # The list shows it, with its cost.
    page.click("nav >> text=Batches")
    row = page.locator(f"tr[data-batch='{batch_id}']")
    expect(row).to_have_attribute("data-status", "completed")
    expect(row.locator("[data-cost=charged]")).to_have_text(re.compile(r"^\$0\.\d+"))


def assert_drawn_from_the_server(browser: Browser, site: Site, batch_id: str, stored: int) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    try:
        tab = context.new_page()
        tab.on("pageerror", lambda error: errors.append(str(error)))
        signed_in(tab, site)
        tab.goto(f"{site.url}#/batch/{batch_id}")
        chart = tab.locator("svg.chart")
        expect(chart).to_have_attribute("data-source", "server")
        # The stored points and the batch's own timestamps (created, started, finalizing, end).
        assert int(chart.get_attribute("data-points") or 0) >= stored > 2
        expect(tab.locator("figure.chart-box figcaption")).to_contain_text("server stored")
    finally:
        context.close()
    assert not errors, errors


def test_cancel_asks_first_then_cancels(page: Page, site: Site) -> None:
    with site.api() as client:
        batch_id = submit(client, [chat_line(f"c{i}", f"{SLOW} {i}") for i in range(20)])
    signed_in(page, site)
    # The list refreshes the running batch's row by itself.
    row = page.locator(f"tr[data-batch='{batch_id}']")
    expect(row.locator("[data-count=completed]")).not_to_have_text("0", timeout=15_000)
    expect(row).to_have_attribute("data-status", "in_progress")
    site.screenshot(page, "batches-list.png")
    page.goto(f"{site.url}#/batch/{batch_id}")
    expect(page.locator("#cancel")).to_be_enabled()

    page.click("#cancel")
    dialog = page.locator("#confirm-cancel")
    expect(dialog).to_be_visible()
    dialog.locator("text=Keep it running").click()
    expect(dialog).to_be_hidden()
    with site.api() as client:
        assert client.get(f"/v1/batches/{batch_id}").json()["status"] not in {
            "cancelling",
            "cancelled",
        }

    page.click("#cancel")
    dialog.locator("button.danger").click()
    expect(page.locator("#batch-status")).to_have_text(re.compile("cancelling|cancelled"))
    expect(page.locator("#batch-status")).to_have_text("cancelled", timeout=30_000)
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("[data-code=batch_cancelled]")).to_be_visible()


def test_a_running_batch_is_paused_resumed_and_given_a_priority(page: Page, site: Site) -> None:
    with site.api() as client:
        batch_id = submit(client, [chat_line(f"p{i}", f"{SLOW} {i}") for i in range(20)])
    signed_in(page, site)
    page.goto(f"{site.url}#/batch/{batch_id}")
    expect(page.locator("#pause")).to_be_enabled(timeout=15_000)
    page.click("#pause")
    # The page shows why it waits, and offers to resume.
    expect(page.locator("#resume")).to_be_visible()
    expect(page.get_by_text("Paused since")).to_be_visible()
    expect(page.locator("body")).to_contain_text("was paused at")
    with site.api() as client:
        assert client.get(f"/v1/batches/{batch_id}").json()["waiting_on"]["code"] == "paused"

    page.fill("#priority-input", "7")
    page.click("#set-priority")
    with site.api() as client:
        got = client.get(f"/v1/batches/{batch_id}").json()
    expect(page.locator("#priority-input")).to_have_value("7")
    assert got["priority"] == 7
    # Above the org's cap: the server's refusal is shown as it says it.
    page.fill("#priority-input", "99")
    page.click("#set-priority")
    expect(page.locator("body")).to_contain_text("at most 10")

    page.click("#resume")
    expect(page.locator("#pause")).to_be_visible()
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#pause")).to_be_disabled()
    expect(page.locator("#set-priority")).to_be_disabled()


def test_a_read_only_key_sees_batches_but_cannot_change_them(page: Page, site: Site) -> None:
    with site.api() as client:
        running = submit(client, [chat_line(f"r{i}", f"{SLOW} {i}") for i in range(20)])
    signed_in(page, site, site.read_key)
    expect(page.locator("#who-text")).to_contain_text("read-only")
    expect(page.locator(f"tr[data-batch='{running}']")).to_be_visible()

    page.goto(f"{site.url}#/batch/{running}")
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("#read-only-reason")).to_contain_text("inference:write")

    page.click("nav >> text=New batch")
    expect(page.locator("#create")).to_be_disabled()
    expect(page.locator("#read-only-reason")).to_be_visible()

    # Should the button be used anyway (a key changed meanwhile), the API's refusal shows.
    expected = api_error(
        site,
        "POST",
        "/v1/files",
        site.read_key,
        data={"purpose": "batch"},
        files={"file": ("r.jsonl", jsonl([chat_line("x")]), "application/jsonl")},
    )
    page.set_input_files("#file", files=[file_payload(jsonl([chat_line("x")]))])
    page.evaluate("document.getElementById('create').disabled = false")
    page.click("#create")
    shown = page.locator("#create-message .api-error")
    expect(shown.locator(".message")).to_have_text(expected["message"])
    expect(shown.locator("[data-field=http]")).to_have_text("403")
    with site.api() as client:
        client.post(f"/v1/batches/{running}/cancel")


def test_a_bad_key_is_refused_with_the_apis_message(page: Page, site: Site) -> None:
    expected = api_error(site, "GET", "/v1/api_key", "bf-not-a-key")
    sign_in(page, site, "bf-not-a-key")
    expect(page.locator("#sign-in-error")).to_have_text(expected["message"])
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0

    expected = api_error(site, "GET", "/admin/v1/engines", "not-the-admin-token")
    sign_in(page, site, "not-the-admin-token")
    expect(page.locator("#sign-in-error")).to_have_text(expected["message"])


def test_sign_out_clears_the_tab(page: Page, site: Site) -> None:
    signed_in(page, site)
    assert page.evaluate("sessionStorage.getItem('backfill.secret')") == site.write_key
    # A reload keeps the tab signed in: the key is in its session storage.
    page.reload()
    expect(page.locator("#view h1")).to_have_text("Batches")
    page.click("#sign-out")
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0
    page.reload()
    expect(page.locator("#sign-in")).to_be_visible()


def test_a_375_px_screen_needs_no_sideways_scrolling(page: Page, site: Site) -> None:
    page.set_viewport_size({"width": 375, "height": 800})
    signed_in(page, site)
    expect(page.locator("tbody tr").first).to_be_visible()
    fits = "document.documentElement.scrollWidth <= window.innerWidth"
    assert page.evaluate(fits)
    site.screenshot(page, "batches-375px.png")
    page.locator("tbody tr a").first.click()
    expect(page.locator("svg.chart")).to_be_visible()
    assert page.evaluate(fits)
    for path in ("#/new", "#/account"):
        page.goto(site.url + path)
        expect(page.locator("#view h1")).not_to_have_text("Batches")
        assert page.evaluate(fits), path


def test_the_admin_token_shows_engines_queue_and_orgs(page: Page, site: Site) -> None:
    with site.api() as client:
        running = submit(client, [chat_line(f"q{i}", f"{SLOW} {i}") for i in range(20)])
    sign_in(page, site, site.admin_token)
    expect(page.locator("#view h1")).to_have_text("Operations")
    expect(page.locator("#engines tr[data-engine=sim]")).to_contain_text("healthy")
    expect(page.locator("#orgs tr[data-org=default]")).to_contain_text("$")
    expect(page.locator("#queue tr[data-model=sim-model]")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('backfill.role')") == "admin"
    # The admin token reads no org's batches.
    assert page.locator("nav >> text=Batches").count() == 0
    site.screenshot(page, "admin.png")
    with site.api() as client:
        client.post(f"/v1/batches/{running}/cancel")


def test_credit_and_ledger(page: Page, site: Site) -> None:
    # A cap no batch of these tests comes near, removed at the end (the site is shared).
    cap = "/admin/v1/orgs/default/spend_caps/month"
    with site.api(site.admin_token) as admin:
        assert admin.put(cap, json={"usd": "1000"}).status_code == 200
    try:
        credit_page_shows_credit_caps_and_ledger(page, site)
    finally:
        with site.api(site.admin_token) as admin:
            admin.delete(cap)


def credit_page_shows_credit_caps_and_ledger(page: Page, site: Site) -> None:
    signed_in(page, site)
    page.click("nav >> text=Credit")
    expect(page.locator("#view h1")).to_have_text("Credit")
    expect(page.locator("#credit")).to_contain_text("default")
    expect(page.locator("[data-credit=credits]")).to_have_text("$100")
    expect(page.locator("[data-credit=balance]")).to_have_text(re.compile(r"^\$\d"))
    with site.api() as client:
        ledger = client.get("/v1/organization/ledger").json()
    first = ledger["data"][0]
    expect(page.locator("tr[data-entry]").first).to_have_attribute("data-entry", first["id"])
    expect(page.locator("tr[data-entry]").last).to_contain_text("Credit")
    with site.api() as client:
        (cap,) = client.get("/v1/organization").json()["spend_caps"]
    row = page.locator('#spend-caps tr[data-cap="org:month"]')
    expect(row).to_contain_text("The organization")
    expect(row).to_contain_text("Month (UTC)")
    expect(row.locator("td").nth(2)).to_have_text("$1000")
    expect(row.locator("[data-cap-left]")).to_have_text(re.compile(r"^\$\d"))
    assert cap["resets_at"] is not None
    expect(row.locator("time")).to_be_visible()


def test_a_batch_that_waits_says_why_until_it_moves(page: Page, site: Site) -> None:
    """Another org's slow lines fill both of the engine's slots and its backlog: a new org's
    batch has nothing running and waits on fair share, which its page says in the API's words
    until its lines start; then it completes and says nothing more."""
    with site.api(site.admin_token) as client:
        made = client.post("/admin/v1/orgs", json={"name": "second-org"})
        assert made.status_code == 200, made.text
        key = client.post(
            "/admin/v1/keys",
            json={"org": "second-org", "scopes": ["inference:write", "requests:read"]},
        )
        assert key.status_code == 200, key.text
        credit = client.post("/admin/v1/credits", json={"org": "second-org", "usd": "10"})
        assert credit.status_code == 200, credit.text
    second_key = key.json()["key"]
    with site.api() as client:
        first = submit(client, [chat_line(f"w{i}", f"[[sim:delay_ms=3500]] {i}") for i in range(6)])

    def engine_full() -> bool:
        with site.api(site.admin_token) as client:
            engines = client.get("/admin/v1/engines").json()["data"]
        return bool(engines[0]["in_flight"] == 2)

    deadline = time.monotonic() + 15
    while not engine_full():
        assert time.monotonic() < deadline, "the first org's lines never filled the engine"
        time.sleep(0.05)
    with site.api(second_key) as client:
        second = submit(client, [chat_line(f"s{i}", f"second {i}") for i in range(2)])

    signed_in(page, site, second_key)
    page.goto(f"{site.url}#/batch/{second}")
    note = page.locator("#batch-waiting")
    expect(note).to_have_attribute("data-code", "fair_share", timeout=10_000)
    expect(note.locator(".message")).to_contain_text("busy with requests of 1 other organization")
    expect(note.locator("[data-field=since]")).to_be_visible()
    site.screenshot(page, "batch-waiting.png")

    # Its lines start once two of the first org's end: the note goes, the batch completes.
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=30_000)
    expect(note).to_have_count(0)
    with site.api() as client:
        client.post(f"/v1/batches/{first}/cancel")
