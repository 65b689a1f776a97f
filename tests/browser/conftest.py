"""A real ``backfill up`` with a simulated engine, and Debian's chromium driven by
Playwright (never a downloaded browser), for the Batches page tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    missing_infrastructure,
    start_server_process,
    start_simulator_process,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ADMIN_TOKEN = "dashboard-admin-token-0123456789"
SCREENSHOTS_ENV = "BACKFILL_SCREENSHOTS_DIR"


@dataclass
class Site:
    """The server under test and the secrets the tests sign in with."""

    server: ServerProcess
    write_key: str
    read_key: str
    admin_token: str
    shots: list[Path]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/"

    def api(self, secret: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.server.port}",
            headers={"Authorization": f"Bearer {secret or self.write_key}"},
            timeout=30,
        )

    def screenshot(self, page: Page, name: str) -> None:
        """Always into the test's folder; also into $BACKFILL_SCREENSHOTS_DIR when it is set
        (how the pictures in docs/screenshots/ are made)."""
        for folder in self.shots:
            folder.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(folder / name), full_page=True)


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        missing_infrastructure("Debian's chromium (apt-get install chromium)")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        missing_infrastructure(f"Playwright for Python ({exc})")
    executable = chromium_path()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    folder = tmp_path_factory.mktemp("dashboard")
    simulator: SimulatorProcess = start_simulator_process("--ttft-ms", "5", "--itl-ms", "0")
    try:
        # Two requests at a time, so a batch of slow lines takes long enough to watch; the
        # planner looks twice a second, so a batch's wait of a few seconds shows on its page.
        server = start_server_process(
            folder,
            simulator.base_url,
            max_concurrency=2,
            extra=f'admin_token = "{ADMIN_TOKEN}"\nscheduling.plan_interval_s = 0.5',
        )
        try:
            made = httpx.post(
                f"http://127.0.0.1:{server.port}/admin/v1/keys",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                json={"org": "default", "scopes": ["requests:read"], "name": "viewer"},
                timeout=30,
            )
            assert made.status_code == 200, made.text
            shots = [folder / "screenshots"]
            if os.environ.get(SCREENSHOTS_ENV):
                shots.append(Path(os.environ[SCREENSHOTS_ENV]))
            yield Site(server, server.key, made.json()["key"], ADMIN_TOKEN, shots)
        finally:
            server.stop()
    finally:
        simulator.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab with its own session storage, as a new window would have. It must end
    without a script error or a Content-Security-Policy violation (the browser logs refused
    API calls as failed loads: those are the tests' own doing)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    opened = context.new_page()
    problems: list[str] = []
    opened.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    opened.on(
        "console",
        lambda message: (
            problems.append(f"console: {message.text}")
            if message.type == "error" and "Failed to load resource" not in message.text
            else None
        ),
    )
    try:
        yield opened
    finally:
        context.close()
    assert not problems, problems
