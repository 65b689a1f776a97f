"""Remote images fetched before the engine slot (the 2026-12-05 review, finding M2): the
dispatcher, the request runner and its fetch pool over a real store, with the real fetcher
against a local HTTPS image host. A line fetching its images holds no slot, so other lines
run meanwhile; a failed or too slow fetch ends its line without a slot; a full pool turns
lines away to the queue; a cancel stops the fetches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from backfill.domain.records import BatchRecord
from backfill.runner.dispatch import TURNED_AWAY_S, Dispatcher
from backfill.runner.engine_pool import EnginePool
from backfill.runner.fetch_pool import FetchPool
from backfill.runner.request import RequestRunner
from tests.contract.test_runner_request import Kit, ScriptedEngine, kit, settle
from tests.contract.test_store import make_org
from tests.integration.test_safe_fetch import PNG, fetcher
from tests.support import eventually
from tests.tls_support import make_pki

__all__ = ["kit"]  # a fixture

MODEL = "m-vision"
LINE_BYTES = 400


@dataclass
class Host:
    """An HTTPS image host on 127.0.0.1: ``/gated`` answers once ``gate`` opens, ``/slow``
    after ``slow_s``, ``/page`` with HTML, ``/cat.png`` at once."""

    base: str = ""
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    slow_s: float = 0.3
    asked: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def gated(request: web.Request) -> web.Response:
            self.asked.append(request.path)
            await self.gate.wait()
            return web.Response(body=PNG, content_type="image/png")

        async def slow(request: web.Request) -> web.Response:
            self.asked.append(request.path)
            await asyncio.sleep(self.slow_s)
            return web.Response(body=PNG, content_type="image/png")

        async def page(request: web.Request) -> web.Response:
            self.asked.append(request.path)
            return web.Response(text="<html></html>", content_type="text/html")

        async def cat(request: web.Request) -> web.Response:
            self.asked.append(request.path)
            return web.Response(body=PNG, content_type="image/png")

        app = web.Application()
        app.router.add_get("/gated/{n}", gated)
        app.router.add_get("/slow/{n}", slow)
        app.router.add_get("/page", page)
        app.router.add_get("/cat.png", cat)
        return app


@pytest.fixture
async def host() -> AsyncIterator[Host]:
    served = Host()
    runner = web.AppRunner(served.app(), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=make_pki().server_context())
    await site.start()
    served.base = f"https://localhost:{runner.addresses[0][1]}"
    try:
        yield served
    finally:
        served.gate.set()
        await runner.cleanup()


@dataclass
class Rig:
    runner: RequestRunner
    pool: EnginePool
    dispatch: Dispatcher
    fetches: FetchPool


@asynccontextmanager
async def rig(
    kit: Kit, engine: ScriptedEngine, *, places: int = 4, total_s: float = 30.0
) -> AsyncIterator[Rig]:
    """A runner with a fetch pool of ``places`` and the real fetcher, one engine slot, and
    a dispatcher that sends lines with remote images to the pool first."""
    async with fetcher(allow_private=True) as safe:
        fetches = FetchPool(places)
        runner = kit.runner(media=safe, fetches=fetches, fetch_total_s=total_s)
        pool = await kit.pool([engine], runner.start)
        fetches.on_free = pool.wake
        dispatch = Dispatcher(
            kit.store,
            kit.store,
            kit.blobs,
            pool,
            kit.leases,
            kit.clock,
            poll_interval_s=0.05,
            gather_s=0.001,
            fetch_first=runner.fetch_first,
        )
        made = Rig(runner, pool, dispatch, fetches)
        try:
            yield made
        finally:
            for task in runner.tasks:
                task.cancel()
            await asyncio.gather(*runner.tasks, return_exceptions=True)


def images(*urls: str) -> Callable[[int], dict[str, Any]]:
    """Bodies whose one message shows ``urls`` (``{i}`` is the line's index)."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]

    def body(i: int) -> dict[str, Any]:
        content = orjson.loads(orjson.dumps(parts).replace(b"{i}", str(i).encode()))
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}

    return body


async def image_batch(kit: Kit, lines: int, *urls: str) -> BatchRecord:
    org = await make_org(kit.store)
    return await kit.batch(org, lines, images(*urls), line_bytes=LINE_BYTES, model=MODEL)


async def rows_of(kit: Kit, batch: BatchRecord, count: int) -> dict[int, dict[str, Any]]:
    return await eventually(lambda: kit.rows(batch), lambda rows: len(rows) == count, 20)


def sent_urls(engine: ScriptedEngine) -> list[str]:
    urls = []
    for _, body in engine.calls:
        for message in body.get("messages", []):
            urls += [part["image_url"]["url"] for part in message["content"]]
    return urls


async def test_a_line_fetching_images_holds_no_slot_while_others_run(kit: Kit, host: Host) -> None:
    engine = ScriptedEngine(MODEL, max_concurrency=1)
    slow = await image_batch(kit, 1, f"{host.base}/gated/{{i}}")
    async with rig(kit, engine) as made:
        assert await made.dispatch.dispatch_once() == 1
        await eventually(lambda: _value(host.asked), lambda asked: asked == ["/gated/0"])
        # Fetching: its lease is held, but not the engine's only slot.
        [slot] = made.pool.slots
        assert (slot.in_flight, engine.sends, made.runner.fetching) == (0, 0, 1)
        assert made.runner.held() == {slow.id: {0}}

        plain = await kit.batch(await make_org(kit.store), 3, model=MODEL)
        while len(await kit.rows(plain)) < 3:
            await made.dispatch.dispatch_once()
            await asyncio.sleep(0.01)
        assert await kit.rows(slow) == {}
        assert made.runner.held() == {slow.id: {0}}

        host.gate.set()
        await rows_of(kit, slow, 1)
        await settle(made.runner)
    assert (await kit.rows(slow))[0]["response"]["status_code"] == 200
    # The engine got the image inline, and only after the plain lines.
    assert engine.sends == 4
    [url] = sent_urls(engine)[-1:]
    assert url.startswith("data:image/png;base64,")


async def test_a_failed_fetch_ends_its_line_without_taking_a_slot(kit: Kit, host: Host) -> None:
    engine = ScriptedEngine(MODEL, max_concurrency=1)
    batch = await image_batch(kit, 2, f"{host.base}/cat.png", f"{host.base}/page")
    async with rig(kit, engine) as made:
        assert await made.dispatch.dispatch_once() == 2
        rows = await rows_of(kit, batch, 2)
        await settle(made.runner)
        [slot] = made.pool.slots
        assert slot.finished == 0  # no request ever started on the slot
    assert engine.sends == 0
    for row in rows.values():
        assert row["error"]["code"] == "image_fetch_failed"
        assert "text/html" in row["error"]["message"]


async def test_a_lines_images_share_one_time_limit(kit: Kit, host: Host) -> None:
    engine = ScriptedEngine(MODEL)
    # Each image comes well within fetch_timeout_s; the three together do not within 0.5 s.
    batch = await image_batch(kit, 1, *(f"{host.base}/slow/{n}" for n in range(3)))
    async with rig(kit, engine, total_s=0.5) as made:
        assert await made.dispatch.dispatch_once() == 1
        [row] = (await rows_of(kit, batch, 1)).values()
    assert engine.sends == 0
    assert row["error"]["code"] == "image_fetch_failed"
    assert "more than 0.5 s to fetch together" in row["error"]["message"]
    assert "fetch_total_timeout_s" in row["error"]["message"]
    assert len(host.asked) < 3


async def test_a_full_pool_turns_lines_away_until_a_place_frees(kit: Kit, host: Host) -> None:
    engine = ScriptedEngine(MODEL, max_concurrency=8)
    batch = await image_batch(kit, 4, f"{host.base}/gated/{{i}}")
    woken = 0
    async with rig(kit, engine, places=1) as made:

        def wake() -> None:
            nonlocal woken
            woken += 1

        made.fetches.on_free = wake
        # One fetching, one waiting for the place: the other two go back to the queue.
        assert await made.dispatch.dispatch_once() == 2
        await kit.leases.settle()
        assert made.fetches.admitted == 2
        assert sorted(made.runner.held()[batch.id]) == [0, 1]
        assert await kit.store.live_leases(batch.id, kit.clock.now()) == 2
        await eventually(lambda: _value(host.asked), lambda asked: len(asked) == 1)

        host.gate.set()
        await rows_of(kit, batch, 2)
        assert woken == 1  # the first line to leave made room for those turned away
        made.fetches.on_free = made.pool.wake
        # Turned away, they wait a moment: claimed at once, they would be turned away again.
        assert await made.dispatch.dispatch_once() == 0
        kit.clock.advance(TURNED_AWAY_S)
        while len(await kit.rows(batch)) < 4:
            await made.dispatch.dispatch_once()
            await asyncio.sleep(0.01)
        await settle(made.runner)
    assert engine.sends == 4
    assert all(url.startswith("data:image/png") for url in sent_urls(engine))


async def test_a_cancel_stops_the_fetches_and_gives_their_leases_back(kit: Kit, host: Host) -> None:
    engine = ScriptedEngine(MODEL)
    batch = await image_batch(kit, 2, f"{host.base}/gated/{{i}}")
    async with rig(kit, engine) as made:
        assert await made.dispatch.dispatch_once() == 2
        assert made.runner.busy(batch.id)
        await made.runner.stop_fetching(batch.id)
        assert not made.runner.busy(batch.id)
        assert made.fetches.admitted == 0
        assert await kit.store.live_leases(batch.id, kit.clock.now()) == 0
    assert engine.sends == 0
    assert await kit.rows(batch) == {}


async def _value(asked: list[str]) -> list[str]:
    return list(asked)


async def test_a_line_whose_engine_left_while_fetching_gives_its_lease_back(
    kit: Kit, host: Host
) -> None:
    """A replica that left the fleet while a line fetched its images may be removed before
    the fetch ends (a fetch holds no slot): the line goes back to the queue, not into the
    backlog of an engine that no longer exists."""
    engine = ScriptedEngine(MODEL)
    batch = await image_batch(kit, 1, f"{host.base}/gated/{{i}}")
    async with rig(kit, engine) as made:
        assert await made.dispatch.dispatch_once() == 1
        await eventually(lambda: _value(host.asked), lambda asked: asked == ["/gated/0"])
        [slot] = made.pool.slots
        made.pool.retire(slot.engine.name)
        await made.pool.reap()
        assert made.pool.slots == []
        host.gate.set()
        await eventually(lambda: _fetching(made), lambda fetching: fetching == 0)
        assert slot.backlog == ()
        assert made.runner.held() == {}
        assert await kit.store.live_leases(batch.id, kit.clock.now() + 60) == 0
    assert engine.sends == 0


async def _fetching(made: Any) -> int:
    return int(made.runner.fetching)
