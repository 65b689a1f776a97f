"""Slow image hosts beside plain lines: does one org's slow remote images pace another org's
plain lines on the same model? (the 2026-12-05 review, finding M2)

    PYTHONPATH=. python -m bench.slow_images              # under a minute
    PYTHONPATH=. python -m bench.slow_images --image-lines 400   # a bigger batch of images

The review's scene: one ``backfill up`` with 4 engine slots and ``fetch_timeout_s = 3`` (the
fetch pool at its defaults) on a fast simulated engine, and an HTTPS image host on loopback
(a throwaway CA) that sends each image a byte at a time over 2.5 s. Measured in one run:

- **alone**: org B's 40 plain lines with nothing else running: the baseline;
- **beside**: 40 plain lines of a fresh org, created once another org's 40 lines of 4 such
  images each are fetching (that batch is cancelled after each measurement).

A time runs from the create call until the poll (every 10 ms) that sees the batch completed;
the medians over ``--reps`` are compared. The target is beside / alone within 1.2x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from aiohttp import web

from bench.common import MODEL, sim_config, start_backfill, start_simulator, stop
from tests.tls_support import make_pki

SLOTS = 4
LINES = 40
IMAGES_PER_LINE = 4
TRICKLE_S = 2.5
FETCH_TIMEOUT_S = 3.0
ADMIN_TOKEN = "bench-admin-token-slow-images-0123456789"
IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(42)


class TrickleHost:
    """Sends each image a byte at a time over TRICKLE_S; counts the answers under way."""

    def __init__(self) -> None:
        self.base = ""
        self.sending = 0
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    async def until_sending(self, holds: Callable[[int], bool]) -> None:
        """Until ``holds`` is true of the number of answers under way."""
        async with self._changed:
            await self._changed.wait_for(lambda: holds(self.sending))

    async def _count(self, change: int) -> None:
        async with self._changed:
            self.sending += change
            self._changed.notify_all()

    async def _image(self, request: web.Request) -> web.StreamResponse:
        await self._count(1)
        try:
            response = web.StreamResponse(
                headers={"Content-Type": "image/png", "Content-Length": str(len(IMAGE))}
            )
            await response.prepare(request)
            for byte in IMAGE:
                await asyncio.sleep(TRICKLE_S / len(IMAGE))
                await response.write(bytes([byte]))
            await response.write_eof()
            return response
        except ConnectionError:
            return web.Response(status=499)  # the fetch was cancelled with its batch
        finally:
            await self._count(-1)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{name}.png", self._image)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=make_pki().server_context())
        await site.start()
        self.base = f"https://localhost:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def config(path: Path, sim_url: str, ca: Path, extra: str = "") -> Path:
    fetch = f"""
admin_token = "{ADMIN_TOKEN}"
fetch_timeout_s = {FETCH_TIMEOUT_S}
fetch_allowed_networks = ["127.0.0.0/8"]
fetch_ca_file = "{ca}"
{extra}
"""
    return sim_config(path, sim_url, SLOTS, fetch, modalities=("text", "image"))


def line(custom_id: str, images: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe {custom_id}."}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content if images else content[0]["text"]}],
            "max_tokens": 8,
        },
    }


class Api:
    def __init__(self, base: str) -> None:
        self.client = httpx.AsyncClient(base_url=base, timeout=60)
        self._admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def org(self, name: str) -> dict[str, str]:
        """A new org with credit; its API headers."""
        for path, body in (
            ("/admin/v1/orgs", {"name": name}),
            ("/admin/v1/credits", {"org": name, "usd": "1000"}),
        ):
            (await self.client.post(path, json=body, headers=self._admin)).raise_for_status()
        key = await self.client.post("/admin/v1/keys", json={"org": name}, headers=self._admin)
        key.raise_for_status()
        return {"Authorization": f"Bearer {key.json()['key']}"}

    async def submit(self, headers: dict[str, str], rows: list[dict[str, Any]]) -> str:
        data = b"".join(orjson.dumps(row) + b"\n" for row in rows)
        uploaded = await self.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", data, "application/jsonl")},
            headers=headers,
        )
        uploaded.raise_for_status()
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        created = await self.client.post("/v1/batches", json=body, headers=headers)
        created.raise_for_status()
        return str(created.json()["id"])

    async def status(self, headers: dict[str, str], batch_id: str) -> dict[str, Any]:
        got = await self.client.get(f"/v1/batches/{batch_id}", headers=headers)
        got.raise_for_status()
        batch: dict[str, Any] = got.json()
        return batch

    async def until(self, headers: dict[str, str], batch_id: str, *status: str) -> None:
        """Poll every 10 ms until the batch is in one of ``status``."""
        while (batch := await self.status(headers, batch_id))["status"] not in status:
            if batch["status"] in ("failed", "expired", "cancelled", "completed"):
                raise RuntimeError(f"{batch_id} ended {batch['status']}, not {status}")
            await asyncio.sleep(0.01)


async def plain_lines(api: Api, name: str) -> float:
    """Seconds from creating a fresh org's plain lines to seeing them completed."""
    headers = await api.org(name)
    rows = [line(f"{name}-{i}", []) for i in range(LINES)]
    start = time.perf_counter()
    batch_id = await api.submit(headers, rows)
    await api.until(headers, batch_id, "completed")
    return time.perf_counter() - start


async def beside_slow_images(api: Api, host: TrickleHost, rep: int, image_lines: int) -> float:
    headers = await api.org(f"images-{rep}")
    rows = [
        line(f"a-{i}", [f"{host.base}/r{rep}-{i}-{k}.png" for k in range(IMAGES_PER_LINE)])
        for i in range(image_lines)
    ]
    slow = await api.submit(headers, rows)
    await host.until_sending(lambda n: n >= SLOTS)  # the image lines are fetching
    took = await plain_lines(api, f"beside-{rep}")
    cancelled = await api.client.post(f"/v1/batches/{slow}/cancel", headers=headers)
    cancelled.raise_for_status()
    # Paced by the image lines, the plain ones end with them: too late to cancel those.
    await api.until(headers, slow, "cancelled", "completed")
    await host.until_sending(lambda n: n == 0)
    return took


async def measure(base: str, reps: int, image_lines: int) -> tuple[list[float], list[float]]:
    host = TrickleHost()
    await host.start()
    api = Api(base)
    try:
        await plain_lines(api, "warm-up")  # the first batch of a process pays for its start
        alone = [await plain_lines(api, f"alone-{rep}") for rep in range(reps)]
        beside = [await beside_slow_images(api, host, rep, image_lines) for rep in range(reps)]
    finally:
        await api.client.aclose()
        await host.stop()
    return alone, beside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--image-lines", type=int, default=LINES, help="org A's lines")
    parser.add_argument("--extra", default="", help="more settings (TOML lines)")
    args = parser.parse_args()
    engine, url = start_simulator("--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "8")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ca = work / "ca.pem"
            ca.write_bytes(make_pki().ca_pem)
            settings = config(work / "slow_images.toml", url, ca, args.extra)
            process, base, _ = start_backfill(settings, work / "data", work / "backfill.log")
            try:
                alone, beside = asyncio.run(measure(base, args.reps, args.image_lines))
            finally:
                stop(process)
    finally:
        stop(engine)
    a, b = statistics.median(alone), statistics.median(beside)
    beside_label = (
        f"beside {args.image_lines} lines x {IMAGES_PER_LINE} images ({TRICKLE_S:g} s each)"
    )
    width = len(beside_label)
    print(f"{LINES} plain lines, {SLOTS} engine slots (median of {args.reps}):")
    print(f"  {'alone':<{width}} : {a:6.2f} s  {_each(alone)}")
    print(f"  {beside_label} : {b:6.2f} s  {_each(beside)}")
    print(f"  {'beside / alone':<{width}} : {b / a:6.2f}x  (target: within 1.2x)")


def _each(times: list[float]) -> str:
    return "(" + ", ".join(f"{t:.2f}" for t in times) + ")"


if __name__ == "__main__":
    main()
