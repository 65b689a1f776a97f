"""Slow image hosts do not pace the other orgs on a model (the 2026-12-05 review, finding M2).

One ``backfill up`` with 4 engine slots. Org A's lines each show 4 https images that their host
sends a byte at a time over 2 s (within ``fetch_timeout_s``); org B's lines are plain. While
the images were fetched holding the engine slots, B's lines got a slot only as A's lines ended
(each after its 4 images, one after another): B finished with A. Fetched in the fetch pool
first, A's lines hold no slot until their images are in, and B finishes before any of A's
lines can, while A's images are still arriving.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.common import spawn_up
from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    Api,
    ServerProcess,
    SimulatorProcess,
    chat_line,
    eventually,
    free_port,
    wait_http,
)
from tests.tls_support import make_pki

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LINES = 40
IMAGES_PER_LINE = 4
TRICKLE_S = 2.0
# A PNG's first bytes, then padding: sent a byte at a time over TRICKLE_S.
IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(32)


@dataclass
class TrickleHost:
    """An HTTPS image host on 127.0.0.1 that sends each image a byte at a time."""

    base: str = ""
    started: int = 0
    finished: int = 0

    @property
    def sending(self) -> int:
        return self.started - self.finished

    async def image(self, request: web.Request) -> web.StreamResponse:
        self.started += 1
        try:
            response = web.StreamResponse(
                headers={"Content-Type": "image/png", "Content-Length": str(len(IMAGE))}
            )
            await response.prepare(request)
            pause = TRICKLE_S / len(IMAGE)
            for byte in IMAGE:
                await asyncio.sleep(pause)
                await response.write(bytes([byte]))
            await response.write_eof()
            return response
        finally:
            self.finished += 1


@pytest.fixture
async def trickle_host() -> AsyncIterator[TrickleHost]:
    host = TrickleHost()
    app = web.Application()
    app.router.add_get("/{name}.png", host.image)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=make_pki().server_context())
    await site.start()
    host.base = f"https://localhost:{runner.addresses[0][1]}"
    try:
        yield host
    finally:
        await runner.cleanup()


@pytest.fixture
def server(tmp_path: Path, fast_sim: SimulatorProcess) -> Iterator[ServerProcess]:
    """``backfill up`` with 4 slots, the admin API, and images fetched from loopback with the
    test CA, each within 3 s (the review's settings; the fetch pool keeps its defaults)."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(make_pki().ca_pem)
    config = tmp_path / "backfill.toml"
    config.write_text(
        f"""
local_engine = false
lease_s = 5.0
admin_token = "{ADMIN_TOKEN}"
fetch_timeout_s = 3.0
fetch_allowed_networks = ["127.0.0.0/8"]
fetch_ca_file = "{ca}"

[[models]]
id = "{SIM_MODEL}"
model_config_id = "sim-model-v1"
context_length = 4096
max_output_tokens = 1024
modalities = ["text", "image"]
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}

[[engines]]
name = "sim"
base_url = "{fast_sim.base_url}"
models = ["{SIM_MODEL}"]
max_concurrency = 4
request_timeout_s = 5.0
"""
    )
    port = free_port()
    log = tmp_path / "server.log"
    process = spawn_up(config, tmp_path / "data", port, log)
    running = ServerProcess(tmp_path / "data", config, port, "", log, process)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", process)
        match = re.search(r"bf-[A-Za-z0-9_-]+", log.read_text())
        assert match, log.read_text()
        running.key = match.group(0)
        yield running
    finally:
        running.stop()


def image_line(base: str, i: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": f"What are these? ({i})"}]
    parts += [
        {"type": "image_url", "image_url": {"url": f"{base}/a{i}-{k}.png"}}
        for k in range(IMAGES_PER_LINE)
    ]
    line = chat_line(f"a-{i}", max_tokens=8)
    line["body"]["messages"] = [{"role": "user", "content": parts}]
    return line


async def test_plain_lines_are_not_paced_by_another_orgs_slow_images(
    server: ServerProcess, trickle_host: TrickleHost
) -> None:
    api = Api(server.port)
    slow = await api.org("slow-images", 1)
    plain = await api.org("plain", 1)
    slow_id = await api.submit(slow, [image_line(trickle_host.base, i) for i in range(LINES)])

    # Org A's lines are fetching: every engine slot would be theirs if fetches held slots.
    async def images_asked() -> int:
        return trickle_host.sending

    await eventually(images_asked, lambda n: n >= 4, 30, what="org A's images to be asked for")

    started = time.monotonic()
    plain_id = await api.submit(plain, [chat_line(f"b-{i}") for i in range(LINES)])

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        return await api.batch(slow, slow_id), await api.batch(plain, plain_id)

    a, b = await eventually(
        both,
        lambda ab: ab[1]["status"] == "completed" or ab[0]["request_counts"]["completed"] > 0,
        120,
        what="org B's batch to end, or one of org A's lines",
        interval_s=0.05,
    )
    plain_s = time.monotonic() - started
    sending = trickle_host.sending
    # B ended before any of A's lines could have (each needs its 4 images, 4 x TRICKLE_S),
    # while A's images were still arriving.
    assert b["status"] == "completed", (a["request_counts"], b["request_counts"])
    assert a["request_counts"]["completed"] == 0, a["request_counts"]
    assert sending > 0
    assert b["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    print(f"\norg B's {LINES} plain lines: {plain_s:.2f} s, with {sending} of A's images arriving")

    # A's lines end too, each once, every image inline.
    a = await eventually(
        lambda: api.batch(slow, slow_id),
        lambda a: a["status"] == "completed",
        120,
        what="org A's batch to complete",
        interval_s=0.2,
    )
    assert a["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    out = await api.rows(slow, a["output_file_id"])
    assert sorted(row["custom_id"] for row in out) == sorted(f"a-{i}" for i in range(LINES))
    for row in out:
        received = row["response"]["body"]["backfill_simulator"]["received"]
        assert (received["images"], received["image_bytes"]) == (
            IMAGES_PER_LINE,
            IMAGES_PER_LINE * len(IMAGE),
        )
    assert trickle_host.started == trickle_host.finished == LINES * IMAGES_PER_LINE
    await api.client.aclose()
