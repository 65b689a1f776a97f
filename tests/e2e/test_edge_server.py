"""The HTTP edge of a real ``backfill up`` over real sockets: big or slow clients are refused or
cut off without the server buffering what they send, and stalled uploads leave nothing behind."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support import (
    ServerProcess,
    SimulatorProcess,
    chat_line,
    jsonl,
    start_server_process,
    start_simulator_process,
)

ADMIN_TOKEN = "edge-admin-token-0123456789abcdef"
MAX_CONNECTIONS = 24
SETTINGS = f"""
admin_token = "{ADMIN_TOKEN}"
header_timeout_s = 1.0
body_idle_timeout_s = 1.0
max_connections = {MAX_CONNECTIONS}
"""
MiB = 2**20


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    simulator: SimulatorProcess = start_simulator_process()
    try:
        server = start_server_process(
            tmp_path_factory.mktemp("edge"), simulator.base_url, extra=SETTINGS
        )
        try:
            yield server
        finally:
            server.stop()
    finally:
        simulator.stop()


@dataclass
class Exchange:
    sent: int  # body bytes the client got to send before the answer came
    answer: bytes

    @property
    def status(self) -> int:
        return int(self.answer.split(b" ", 2)[1])

    def error(self) -> dict[str, object]:
        error: dict[str, object] = orjson.loads(self.answer.split(b"\r\n\r\n", 1)[1])["error"]
        return error


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    # Without the limits under test these calls would wait for ever; 30 s bounds the failure.
    sock.settimeout(30)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer ends it too)."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def send_until_answered(sock: socket.socket, head: bytes, total: int, chunk: bytes) -> Exchange:
    """Send ``head``, then ``chunk`` until ``total`` bytes went or the server answered."""
    sock.sendall(head)
    sent = 0
    try:
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while we were still sending
    return Exchange(sent, read_until_closed(sock))


def peak_rss_kib(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def chunked(size: int) -> bytes:
    return b"%x\r\n" % size + b" " * size + b"\r\n"


# ---- H1, M5: bodies -------------------------------------------------------------------------


def test_unauthenticated_admin_body_is_refused_before_it_is_read(
    edge_server: ServerProcess,
) -> None:
    before = peak_rss_kib(edge_server)
    declared = 300 * MiB
    for framing in (f"Content-Length: {declared}", "Transfer-Encoding: chunked"):
        head = (
            f"POST /admin/v1/orgs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n"
        ).encode()
        body = b" " * MiB if "Length" in framing else chunked(MiB)
        with connect(edge_server) as sock:
            exchange = send_until_answered(sock, head, declared, body)
        assert exchange.status == 401, exchange.answer[:300]
        assert exchange.error()["code"] == "invalid_admin_token"
        # The answer came while almost all of the body was still unsent.
        assert exchange.sent < declared // 10
    assert peak_rss_kib(edge_server) - before < 64 * 1024


def test_streamed_json_body_is_cut_at_the_limit(edge_server: ServerProcess) -> None:
    head = (
        f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {edge_server.key}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    total = 200 * MiB
    with connect(edge_server) as sock:
        exchange = send_until_answered(sock, head, total, chunked(64 * 1024))
    assert exchange.status == 413, exchange.answer[:300]
    assert exchange.error()["code"] == "request_too_large"
    assert exchange.sent < total // 10


# ---- M4: heads, slow clients, connections -----------------------------------------------------


def test_endless_header_is_refused_without_buffering_it(edge_server: ServerProcess) -> None:
    before = peak_rss_kib(edge_server)
    total = 50 * MiB
    with connect(edge_server) as sock:
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
        exchange = send_until_answered(sock, head, total, b"a" * 65536)
    assert exchange.status == 431, exchange.answer[:300]
    assert exchange.error()["code"] == "request_header_too_large"
    assert exchange.sent < total // 10
    assert peak_rss_kib(edge_server) - before < 32 * 1024


def test_big_header_sent_at_once_is_refused(edge_server: ServerProcess) -> None:
    with connect(edge_server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:300]


def test_half_sent_header_is_closed_after_the_header_timeout(edge_server: ServerProcess) -> None:
    with connect(edge_server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"header_timeout_s" in answer


def test_connection_that_sends_nothing_is_closed(edge_server: ServerProcess) -> None:
    with connect(edge_server) as sock:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_idle_keep_alive_connection_is_not_cut_by_the_header_timeout(
    edge_server: ServerProcess,
) -> None:
    # The head deadline runs from a request's first byte; the gap before it belongs to the
    # keep-alive timeout (5 s), which is longer than header_timeout_s here.
    with connect(edge_server) as sock:
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(1.5)


def test_stalled_upload_is_closed_and_leaves_no_temporary_files(
    edge_server: ServerProcess,
) -> None:
    boundary = "stalledupload"
    content = jsonl([chat_line(f"line-{i}", "x" * 100) for i in range(2000)])
    start = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode() + content
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {edge_server.key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(start) * 10}\r\n\r\n"
    ).encode()
    tmp = edge_server.data_dir / "blobs" / ".tmp"
    with connect(edge_server) as sock:
        sock.sendall(head + start)
        deadline = time.monotonic() + 30
        while not any(tmp.iterdir()):  # the upload is being stored
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.02)
        assert read_until_closed(sock) == b""
    deadline = time.monotonic() + 30
    while any(tmp.iterdir()):
        assert time.monotonic() < deadline, list(tmp.iterdir())
        time.sleep(0.05)
    with edge_server.client() as client:
        assert client.get("/v1/files").json()["data"] == []


def test_connections_past_the_cap_are_refused(edge_server: ServerProcess) -> None:
    held = [connect(edge_server) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(edge_server) as extra:
            answer = read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"max_connections" in answer
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 30
    while True:  # once they are gone, new connections are served again
        try:
            with edge_server.client() as client:
                if client.get("/healthz").status_code == 200:
                    break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
