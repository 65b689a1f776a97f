"""The fetcher for users' remote images against a real local HTTPS server (SPEC §10.4)."""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook

from backfill.adapters.fetch import FetchPolicy, Lookup, SafeFetcher
from backfill.adapters.fetch.addresses import non_public_kind
from backfill.adapters.notify.webhooks import SignedWebhooks
from backfill.ports import DeliveryFailed, FetchedMedia, MediaFetcher, MediaFetchFailed
from tests.tls_support import make_pki

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
IMAGES = ("image/png", "image/jpeg")
# Bodies that begin as each image type does.
SIGNED = {
    "image/png": PNG,
    "image/jpeg": b"\xff\xd8\xff\xe0\0\x10JFIF\0" + bytes(64),
    "image/gif": b"GIF89a\x01\0\x01\0" + bytes(64),
    "image/webp": b"RIFF\x24\0\0\0WEBPVP8 " + bytes(64),
}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class ImageServer:
    port: int
    seen: list[Seen] = field(default_factory=list)

    def url(self, path: str, host: str = "localhost", scheme: str = "https") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def _app(server: ImageServer) -> web.Application:
    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        body = await request.read()
        server.seen.append(Seen(request.method, request.path, dict(request.headers), body))
        return await handler(request)

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def page(_: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="text/html")

    async def signed(request: web.Request) -> web.Response:
        content_type = f"image/{request.match_info['kind']}"
        return web.Response(body=SIGNED[content_type], content_type=content_type)

    async def disguised(_: web.Request) -> web.Response:
        return web.Response(text="<html><body>not an image</body></html>", content_type="image/png")

    async def gzipped(_: web.Request) -> web.Response:
        # Compressed, with no Content-Encoding to say so.
        return web.Response(body=gzip.compress(PNG), content_type="image/png")

    async def missing(_: web.Request) -> web.Response:
        return web.Response(status=404, text="not here")

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=PNG * 4, content_type="image/png")

    async def dribble(request: web.Request, chunk: bytes, pause_s: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for _ in range(10_000):
                await response.write(chunk)
                await asyncio.sleep(pause_s)
        except ConnectionError:
            pass  # the client gave up, as it should
        return response

    async def endless(request: web.Request) -> web.StreamResponse:
        return await dribble(request, b"x" * 16384, 0)

    async def slow(request: web.Request) -> web.StreamResponse:
        return await dribble(request, b"x", 0.1)

    async def hop(request: web.Request) -> web.Response:
        left = int(request.match_info["left"])
        location = f"/hop/{left - 1}" if left > 1 else "/image.png"
        raise web.HTTPFound(location)

    async def to(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["location"])

    async def cookie(_: web.Request) -> web.Response:
        response = web.Response(body=PNG, content_type="image/png")
        response.set_cookie("visitor", "secret")
        return response

    async def hook(_: web.Request) -> web.Response:
        return web.Response(status=204)

    async def moved(_: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/hook")

    app = web.Application(middlewares=[record])
    app.router.add_get("/image.png", image)
    app.router.add_get("/page.html", page)
    app.router.add_get("/missing", missing)
    app.router.add_get("/signed/{kind}", signed)
    app.router.add_get("/disguised.png", disguised)
    app.router.add_get("/gzipped.png", gzipped)
    app.router.add_get("/big", big)
    app.router.add_get("/endless", endless)
    app.router.add_get("/slow", slow)
    app.router.add_get("/hop/{left}", hop)
    app.router.add_get("/to", to)
    app.router.add_get("/cookie", cookie)
    app.router.add_post("/hook", hook)
    app.router.add_post("/moved", moved)
    return app


@pytest.fixture
async def server() -> AsyncIterator[ImageServer]:
    """An HTTPS server on 127.0.0.1 with a certificate for ``localhost`` from the test CA."""
    running = ImageServer(port=0)
    runner = web.AppRunner(_app(running), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=make_pki().server_context())
    await site.start()
    running.port = int(runner.addresses[0][1])
    try:
        yield running
    finally:
        await runner.cleanup()


@dataclass
class Answers:
    """A name resolver answering from a table, counting its calls."""

    table: dict[str, Sequence[str]]
    calls: list[str] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown name")
        return self.table[host]


def local() -> Answers:
    return Answers({"localhost": ["127.0.0.1"]})


@asynccontextmanager
async def fetcher(
    lookup: Lookup | None = None, *, trusted: bool = True, **policy: Any
) -> AsyncIterator[SafeFetcher]:
    limits: dict[str, Any] = {"max_bytes": 100_000, "timeout_s": 2.0, "connect_timeout_s": 1.0}
    context = make_pki().client_context() if trusted else None
    safe = SafeFetcher(
        FetchPolicy(**(limits | {"ssl_context": context} | policy)), lookup=lookup or local()
    )
    try:
        yield safe
    finally:
        await safe.close()


async def refused(safe: SafeFetcher, url: str, content_types: Sequence[str] = IMAGES) -> str:
    with pytest.raises(MediaFetchFailed) as caught:
        await safe.fetch(url, content_types)
    assert caught.value.code == "image_fetch_failed"
    return caught.value.message


async def test_a_png_is_fetched_without_credentials(server: ImageServer) -> None:
    async with fetcher(allow_private=True) as safe:
        port: MediaFetcher = safe
        media = await port.fetch(server.url("/image.png"), IMAGES)
    assert media == FetchedMedia(content_type="image/png", data=PNG)
    assert [s.path for s in server.seen] == ["/image.png"]
    assert "Authorization" not in server.seen[0].headers
    assert "Cookie" not in server.seen[0].headers


async def test_no_cookie_is_kept_and_no_proxy_is_taken_from_the_environment(
    server: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens: using it would fail
    async with fetcher(allow_private=True) as safe:
        await safe.fetch(server.url("/cookie"), IMAGES)
        await safe.fetch(server.url("/image.png"), IMAGES)
    assert [s.path for s in server.seen] == ["/cookie", "/image.png"]
    assert "Cookie" not in server.seen[1].headers


async def test_plain_http_is_refused(server: ImageServer) -> None:
    async with fetcher(allow_private=True) as safe:
        message = await refused(safe, server.url("/image.png", scheme="http"))
    assert message == (
        f"http://localhost:{server.port}/…: the URL is plain http; "
        "Backfill fetches only public HTTPS URLs"
    )
    assert server.seen == []


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("https://user:secret@images.example/a.png", "carries a user name or password"),
        ("https://:secret@images.example/a.png", "carries a user name or password"),
        ("ftp://images.example/a.png", "not an https URL"),
        ("file:///etc/passwd", "not an https URL"),
        ("images.example/a.png", "not an https URL"),
        ("https:///a.png", "has no host"),
        ("https://images.example/" + "a" * 8200, "longer than 8192 characters"),
        ("https://exa mple.example/a.png", "not a valid host name"),
        ("https://images.example:99999/a.png", "not valid"),
        ("https://1.2.3.4.5/a.png", "not a valid IPv4 address"),
        ("https://256.0.0.1/a.png", "not a valid IPv4 address"),
    ],
)
async def test_malformed_urls_are_refused_before_any_lookup(url: str, rule: str) -> None:
    lookup = Answers({})
    async with fetcher(lookup) as safe:
        message = await refused(safe, url)
    assert rule in message
    assert "secret" not in message
    assert lookup.calls == []


@pytest.mark.parametrize(
    ("answers", "kind", "shown"),
    [
        (["127.0.0.1"], "a loopback address", "127.0.0.1"),
        (["10.0.0.5"], "a private address", "10.0.0.5"),
        (["192.168.1.1"], "a private address", "192.168.1.1"),
        (["172.31.255.1"], "a private address", "172.31.255.1"),
        (["100.64.0.1"], "a shared (carrier-grade NAT) address", "100.64.0.1"),
        (["169.254.169.254"], "a link-local address", "169.254.169.254"),
        (["0.0.0.0"], "a this-network address", "0.0.0.0"),
        (["224.0.0.251"], "a multicast address", "224.0.0.251"),
        (["::1"], "a loopback address", "::1"),
        (["fe80::1"], "a link-local address", "fe80::1"),
        (["fe80::1%eth0"], "a link-local address", "fe80::1"),
        (["fc00::1"], "a private address", "fc00::1"),
        (["fd12:3456::1"], "a private address", "fd12:3456::1"),
        (["::ffff:10.0.0.1"], "a private address", "::ffff:a00:1"),
        (["::ffff:127.0.0.1"], "a loopback address", "::ffff:7f00:1"),
        (["64:ff9b::a9fe:a9fe"], "a link-local address", "64:ff9b::a9fe:a9fe"),
        (["2002:7f00:1::"], "a loopback address", "2002:7f00:1::"),
        # One bad answer spoils the name: Backfill does not pick the good one.
        (["93.184.216.34", "10.0.0.5"], "a private address", "10.0.0.5"),
        (["2606:4700::1111", "::1"], "a loopback address", "::1"),
    ],
)
async def test_names_resolving_to_non_public_addresses_are_refused(
    server: ImageServer, answers: list[str], kind: str, shown: str
) -> None:
    lookup = Answers({"images.example": answers})
    async with fetcher(lookup) as safe:
        message = await refused(safe, f"https://images.example:{server.port}/a.png?sig=abc")
    assert message == (
        f"https://images.example:{server.port}/…: the host resolves to {kind}; "
        "Backfill fetches only public HTTPS URLs"
    )
    # What the name resolves to inside the network is not told.
    assert shown not in message
    assert lookup.calls == ["images.example"]
    assert server.seen == []


async def test_a_name_that_does_not_resolve_is_refused() -> None:
    async with fetcher(Answers({})) as safe:
        message = await refused(safe, "https://nowhere.example/a.png")
    assert message == "https://nowhere.example/…: the host name does not resolve"


@pytest.mark.parametrize(
    ("host", "kind", "shown"),
    [
        ("127.0.0.1", "a loopback address", "127.0.0.1"),
        ("2130706433", "a loopback address", "127.0.0.1"),
        ("0x7f.0.0.1", "a loopback address", "127.0.0.1"),
        ("0x7f000001", "a loopback address", "127.0.0.1"),
        ("017700000001", "a loopback address", "127.0.0.1"),
        ("127.1", "a loopback address", "127.0.0.1"),
        ("127.0.0.1.", "a loopback address", "127.0.0.1"),
        ("0", "a this-network address", "0.0.0.0"),
        ("169.254.169.254", "a link-local address", "169.254.169.254"),
        ("2852039166", "a link-local address", "169.254.169.254"),
        ("10.0.0.5", "a private address", "10.0.0.5"),
        ("[::1]", "a loopback address", "::1"),
        ("[::ffff:127.0.0.1]", "a loopback address", "::ffff:7f00:1"),
        ("[fe80::1]", "a link-local address", "fe80::1"),
        ("[fc00::1]", "a private address", "fc00::1"),
    ],
)
async def test_hosts_written_as_addresses_are_refused(
    server: ImageServer, host: str, kind: str, shown: str
) -> None:
    lookup = Answers({})
    async with fetcher(lookup) as safe:
        message = await refused(safe, f"https://{host}:{server.port}/latest/meta-data")
    assert f"the host is {kind} ({shown}); Backfill fetches only public HTTPS URLs" in message
    assert lookup.calls == []
    assert server.seen == []


async def test_a_public_address_written_as_a_number_is_refused() -> None:
    async with fetcher(Answers({})) as safe:
        message = await refused(safe, "https://134744072/a.png")
    assert message.endswith("the host is the address 8.8.8.8 written in another form")


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "93.184.216.34", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"],
)
def test_public_addresses_pass(address: str) -> None:
    assert non_public_kind(ip_address(address)) is None


@pytest.mark.parametrize(
    "address",
    [
        "192.0.2.1",
        "198.51.100.1",
        "203.0.113.1",
        "198.18.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "192.0.0.8",
        "2001:db8::1",
        "2001::1",
        "ff02::1",
        "fec0::1",
        "::",
        "::7f00:1",
        "::808:808",
        "100::1",
        "64:ff9b:1::1",
        "5f00::1",
        "2002:a00:1::",
    ],
)
def test_reserved_and_documentation_addresses_are_not_public(address: str) -> None:
    assert non_public_kind(ip_address(address)) is not None


async def test_a_rebinding_name_never_reaches_the_local_server(server: ImageServer) -> None:
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["93.184.216.34"] if len(calls) == 1 else ["127.0.0.1"]

    url = f"https://rebind.example:{server.port}/image.png"
    async with fetcher(rebinding, connect_timeout_s=0.5, timeout_s=1.5) as safe:
        # The checked public answer is the one connected to; whatever answers there (or
        # nothing), it is not the local server.
        first = await refused(safe, url)
        second = await refused(safe, url)
    assert "resolves to" not in first
    assert calls == ["rebind.example", "rebind.example"]
    assert "the host resolves to a loopback address;" in second
    assert server.seen == []


@pytest.mark.parametrize(
    ("location", "rule"),
    [
        ("https://internal.example/secret", "the host resolves to a private address;"),
        ("https://169.254.169.254/latest/meta-data", "a link-local address (169.254.169.254)"),
        ("https://127.0.0.2/", "the host is a loopback address (127.0.0.2)"),
        ("https://user:pw@localhost/image.png", "carries a user name or password"),
        ("http://localhost/image.png", "the URL is plain http"),
    ],
)
async def test_redirect_targets_are_checked_like_the_url(
    server: ImageServer, location: str, rule: str
) -> None:
    lookup = Answers({"localhost": ["127.0.0.1"], "internal.example": ["10.0.0.5"]})
    # Only the test server's own address is allowed, so the first hop is reached.
    async with fetcher(lookup, allowed_networks=("127.0.0.1/32",)) as safe:
        message = await refused(safe, server.url(f"/to?location={location}"))
    assert f"(redirected to {location.split('://')[0]}://" in message
    assert rule in message
    assert [s.path for s in server.seen] == ["/to"]


async def test_redirects_up_to_the_limit_are_followed(server: ImageServer) -> None:
    async with fetcher(allow_private=True) as safe:
        media = await safe.fetch(server.url("/hop/3"), IMAGES)
        message = await refused(safe, server.url("/hop/4"))
    assert media.data == PNG
    assert message == f"https://localhost:{server.port}/…: it redirects more than 3 times"
    assert len(server.seen) == 4 + 4


async def test_no_redirect_is_followed_when_the_limit_is_zero(server: ImageServer) -> None:
    async with fetcher(allow_private=True, max_redirects=0) as safe:
        message = await refused(safe, server.url("/hop/1"))
    assert message.endswith("it redirects more than 0 times")


async def test_a_body_over_the_limit_is_refused_from_its_content_length(
    server: ImageServer,
) -> None:
    async with fetcher(allow_private=True, max_bytes=len(PNG)) as safe:
        message = await refused(safe, server.url("/big"))
    assert message == f"https://localhost:{server.port}/…: the body is larger than {len(PNG)} bytes"


async def test_an_endless_body_is_cut_at_the_limit(server: ImageServer) -> None:
    # Cut when it passes the limit, not ended by the timeout: the refusal comes in well inside
    # the timeout set here (a fetch that read on until the timeout would take all of it).
    timeout_s = 10.0
    start = time.monotonic()
    async with fetcher(allow_private=True, max_bytes=100_000, timeout_s=timeout_s) as safe:
        message = await refused(safe, server.url("/endless"))
    assert message.endswith("the body is larger than 100000 bytes")
    assert time.monotonic() - start < timeout_s / 2


async def test_a_dribbling_body_ends_at_the_time_limit(server: ImageServer) -> None:
    # Ended by the timeout set here: not before it, and not long after.
    timeout_s = 1.0
    start = time.monotonic()
    async with fetcher(allow_private=True, timeout_s=timeout_s) as safe:
        message = await refused(safe, server.url("/slow"))
    elapsed = time.monotonic() - start
    assert message == f"https://localhost:{server.port}/…: no complete answer within 1 s"
    assert 0.9 * timeout_s < elapsed < 1.8 * timeout_s


async def test_a_type_not_asked_for_is_refused(server: ImageServer) -> None:
    async with fetcher(allow_private=True) as safe:
        message = await refused(safe, server.url("/page.html"))
        other = await refused(safe, server.url("/image.png"), ["image/jpeg"])
    assert message.endswith("the content type text/html is not one of image/jpeg, image/png")
    assert other.endswith("the content type image/png is not one of image/jpeg")


async def test_an_image_is_fetched_only_when_its_bytes_begin_as_its_type(
    server: ImageServer,
) -> None:
    # The 2026-12-05 review, Info: HTML served as image/png went on as data:image/png, and a
    # gzip body without Content-Encoding stayed compressed.
    async with fetcher(allow_private=True) as safe:
        for content_type, data in SIGNED.items():
            kind = content_type.split("/")[1]
            media = await safe.fetch(server.url(f"/signed/{kind}"), SIGNED)
            assert media == FetchedMedia(content_type=content_type, data=data)
        page = await refused(safe, server.url("/disguised.png"))
        packed = await refused(safe, server.url("/gzipped.png"))
    for message, path in ((page, "disguised.png"), (packed, "gzipped.png")):
        assert message == (
            f"https://localhost:{server.port}/…: the body is not image/png: its first bytes are "
            "not those of that type (a page, or a compressed body, sent as an image?)"
        ), path


async def test_an_error_status_is_refused_with_the_status(server: ImageServer) -> None:
    async with fetcher(allow_private=True) as safe:
        message = await refused(safe, server.url("/missing"))
    assert message == f"https://localhost:{server.port}/…: the server answered 404"


async def test_an_untrusted_certificate_is_refused(server: ImageServer) -> None:
    async with fetcher(allow_private=True, trusted=False) as safe:
        message = await refused(safe, server.url("/image.png"))
    assert "the server's TLS certificate could not be verified" in message
    assert server.seen == []


async def test_the_certificate_is_checked_against_the_url_host(server: ImageServer) -> None:
    lookup = Answers({"images.example": ["127.0.0.1"]})
    async with fetcher(lookup, allow_private=True) as safe:
        message = await refused(safe, server.url("/image.png", host="images.example"))
    assert "could not be verified (Hostname mismatch" in message
    assert server.seen == []


async def test_webhooks_are_posted_signed_under_the_same_rules(server: ImageServer) -> None:
    policy = FetchPolicy(
        max_bytes=1000,
        timeout_s=2.0,
        connect_timeout_s=1.0,
        allowed_networks=("127.0.0.1/32",),
        ssl_context=make_pki().client_context(),
    )
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    sender = SignedWebhooks(policy, lookup=local())
    try:
        status = await sender.deliver(server.url("/hook"), "msg_1", b'{"id":"batch_1"}', [secret])
        moved = await sender.deliver(server.url("/moved"), "msg_2", b"{}", [secret])
        with pytest.raises(DeliveryFailed) as caught:
            await sender.deliver(f"https://10.0.0.5:{server.port}/hook", "msg_3", b"{}", [secret])
    finally:
        await sender.close()
    assert status == 204
    assert moved == 307
    assert [s.path for s in server.seen] == ["/hook", "/moved"]  # the redirect not followed
    hook = server.seen[0]
    assert (hook.method, hook.body) == ("POST", b'{"id":"batch_1"}')
    assert hook.headers["Content-Type"] == "application/json"
    assert hook.headers["webhook-id"] == "msg_1"
    headers = {k.lower(): v for k, v in hook.headers.items()}
    Webhook(secret).verify(hook.body, headers)
    assert "the host is a private address (10.0.0.5)" in caught.value.reason
