"""The lean HTTP/1.1 client of the engine adapter against servers that answer in each way
HTTP/1.1 allows: sized, chunked, ended by the connection's close, kept alive or not, over TLS;
and against servers that break off or hang."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop

from backfill.adapters.engines import http1
from backfill.adapters.engines.http1 import ConnectionClosed, Http1Pool
from tests.tls_support import make_pki

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]
"""Gets one whole request (head and body); answers on the writer; True to keep the
connection for the next request."""


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler, tls: bool = False) -> AsyncIterator[tuple[str, list[int]]]:
    """Yields the server's URL and the requests seen on each connection, in order."""
    per_connection: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        per_connection.append(0)
        me = len(per_connection) - 1
        try:
            while True:
                request = await _read_request(reader)
                per_connection[me] += 1
                if not await handler(request, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    context = make_pki().server_context() if tls else None
    srv = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", per_connection
    finally:
        srv.close()


def pool(url: str, **kw: object) -> Http1Pool:
    return Http1Pool(url, {"Content-Type": "application/json"}, connect_s=2, total_s=5, **kw)  # type: ignore[arg-type]


async def sized(request: bytes, writer: asyncio.StreamWriter) -> bool:
    body = request.split(b"\r\n\r\n", 1)[1]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return True


async def test_a_sized_answer_and_its_connection_is_used_again() -> None:
    async with server(sized) as (url, per_connection):
        client = pool(url)
        for n in range(3):
            answer = await client.post("/v1/chat/completions", b'{"n": %d}' % n)
            assert (answer.status, answer.body, answer.retry_after) == (200, b'{"n": %d}' % n, None)
        client.close()
    assert per_connection == [3]


async def test_the_request_carries_the_path_prefix_headers_and_url_credentials() -> None:
    seen: list[bytes] = []

    async def record(request: bytes, writer: asyncio.StreamWriter) -> bool:
        seen.append(request)
        return await sized(request, writer)

    async with server(record) as (url, _):
        client = pool(url.replace("://", "://ann:s%40cret@") + "/engine/")
        await client.post("/v1/chat/completions", b"{}")
        client.close()
    head = seen[0].split(b"\r\n\r\n")[0].decode().split("\r\n")
    assert head[0] == "POST /engine/v1/chat/completions HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in head
    assert "Authorization: Basic " + base64.b64encode(b"ann:s@cret").decode() in head
    assert "Content-Type: application/json" in head
    assert "Content-Length: 2" in head
    assert "Accept-Encoding: identity" in head


async def test_a_chunked_answer_with_retry_after() -> None:
    async def chunked(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\n"
            b"retry-after: 7\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        return True

    async with server(chunked) as (url, per_connection):
        client = pool(url)
        for _ in range(2):
            answer = await client.post("/x", b"{}")
            assert (answer.status, answer.body, answer.retry_after) == (429, b"hello world", "7")
        client.close()
    assert per_connection == [2]


async def test_an_answer_ended_by_the_close_and_connection_close_are_not_reused() -> None:
    async def until_close(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        return False

    async def says_close(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        return True  # the client must not send a second request on it anyway

    for handler, body in ((until_close, b"all of it"), (says_close, b"ok")):
        async with server(handler) as (url, per_connection):
            client = pool(url)
            assert (await client.post("/x", b"{}")).body == body
            assert (await client.post("/x", b"{}")).body == body
            client.close()
        assert per_connection == [1, 1]


async def test_a_connection_cut_mid_answer_fails_and_the_next_request_gets_a_new_one() -> None:
    calls = 0

    async def cut_first(request: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            return False
        return await sized(request, writer)

    async with server(cut_first) as (url, per_connection):
        client = pool(url)
        with pytest.raises(ConnectionClosed, match="closed the connection before its answer"):
            await client.post("/x", b"{}")
        assert (await client.post("/x", b"{}")).body == b"{}"
        client.close()
    assert per_connection == [1, 1]


async def test_garbage_is_not_an_answer() -> None:
    async def garbage(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return True

    async with server(garbage) as (url, _):
        client = pool(url)
        with pytest.raises(ConnectionClosed, match=r"not HTTP/1\.1"):
            await client.post("/x", b"{}")
        client.close()


async def test_a_hang_times_out_and_its_connection_is_dropped() -> None:
    release = asyncio.Event()

    async def hang_first(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if not release.is_set():
            release.set()
            await asyncio.sleep(30)
        return await sized(request, writer)

    async with server(hang_first) as (url, per_connection):
        client = Http1Pool(url, {}, connect_s=2, total_s=0.2)
        with pytest.raises(TimeoutError):
            await client.post("/x", b"{}")
        assert (await client.post("/x", b"{}")).body == b"{}"
        client.close()
    assert len(per_connection) == 2


async def test_a_cancelled_request_does_not_leave_its_answer_for_the_next() -> None:
    async def slow(request: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.2)
        return await sized(request, writer)

    async with server(slow) as (url, per_connection):
        client = pool(url)
        task = asyncio.create_task(client.post("/x", b'"first"'))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.post("/x", b'"second"')).body == b'"second"'
        client.close()
    assert len(per_connection) == 2


async def test_a_connection_idle_too_long_is_not_risked(monkeypatch: pytest.MonkeyPatch) -> None:
    async with server(sized) as (url, per_connection):
        client = pool(url)
        await client.post("/x", b"{}")
        monkeypatch.setattr(http1, "IDLE_REUSE_S", 0.0)
        await client.post("/x", b"{}")
        client.close()
    assert per_connection == [1, 1]


async def test_a_refused_connection_is_an_os_error() -> None:
    async with server(sized) as (url, _):
        pass  # closed: nothing listens there now
    client = pool(url)
    with pytest.raises(OSError):
        await client.post("/x", b"{}")


async def test_https_with_a_trusted_and_an_untrusted_certificate() -> None:
    async with server(sized, tls=True) as (url, _):
        trusted = pool(url, tls=make_pki().client_context())
        assert (await trusted.post("/x", b"{}")).status == 200
        trusted.close()
        untrusted = pool(url)  # the system's store does not hold the test CA
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.post("/x", b"{}")


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        Http1Pool("ftp://example.com", {}, connect_s=1, total_s=1)


async def test_a_connection_cut_before_any_answer_on_a_reused_connection_fails() -> None:
    calls = 0

    async def cut_second(request: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal calls
        calls += 1
        return calls == 1 and await sized(request, writer)

    async with server(cut_second) as (url, per_connection):
        client = pool(url)
        assert (await client.post("/x", b"{}")).status == 200
        with pytest.raises(ConnectionClosed):
            await client.post("/x", b"{}")
        client.close()
    assert per_connection == [2]


def test_on_uvloop_as_the_server_runs_it() -> None:
    """``backfill up`` runs on uvloop, whose transports only resemble asyncio's."""

    async def exchange() -> list[int]:
        async with server(chunk_or_size) as (url, per_connection):
            client = pool(url)
            for body in (b"{}", b"chunked"):
                assert (await client.post("/x", body)).body == body
            client.close()
        return per_connection

    async def chunk_or_size(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if request.endswith(b"chunked"):
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\nchunked\r\n0\r\n\r\n"
            )
            return True
        return await sized(request, writer)

    assert uvloop.run(exchange()) == [2]


async def test_interim_answers_are_skipped() -> None:
    async def interim_first(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        return await sized(request, writer)

    async with server(interim_first) as (url, per_connection):
        client = pool(url)
        for n in range(3):
            answer = await client.post("/x", b"[%d]" % n)
            assert (answer.status, answer.body) == (200, b"[%d]" % n)
        client.close()
    assert per_connection == [3]


async def test_an_unsized_answer_cut_by_a_reset_is_not_whole() -> None:
    async def reset_mid_body(_: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart of it")
        await writer.drain()
        await asyncio.sleep(0.05)
        # RST, not FIN (linger 0): the body did not end here.
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return False

    async with server(reset_mid_body) as (url, _):
        client = pool(url)
        with pytest.raises(ConnectionClosed):
            await client.post("/x", b"{}")
        client.close()


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        Http1Pool("http://e", {"Authorization": "Bearer k\r\nX-Evil: 1"}, connect_s=1, total_s=1)
