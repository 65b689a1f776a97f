"""The HTTP edge of a real ``backfill up`` over real sockets: big or slow clients are refused or
cut off without the server buffering what they send, and stalled uploads leave nothing behind."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
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


def reset_peak_rss_kib(server: ServerProcess) -> int:
    """Lower the server's peak RSS to its current RSS and return it: the server is shared by the
    module, so a peak an earlier test left would otherwise hide this test's growth."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return peak_rss_kib(server)


def chunked(size: int) -> bytes:
    return b"%x\r\n" % size + b" " * size + b"\r\n"


# ---- H1, M5: bodies -------------------------------------------------------------------------


def test_unauthenticated_admin_body_is_refused_before_it_is_read(
    edge_server: ServerProcess,
) -> None:
    before = reset_peak_rss_kib(edge_server)
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
    before = reset_peak_rss_kib(edge_server)
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


# ---- a whole request in one read is not a big head --------------------------------------------


def upload_request(server: ServerProcess, content: bytes, boundary: str = "onewrite") -> bytes:
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


def jsonl_of(size: int) -> bytes:
    """Batch input of about ``size`` bytes."""
    line = len(jsonl([chat_line("l-0", "y" * 200)]))
    return jsonl([chat_line(f"l-{i}", "y" * 200) for i in range(size // line)])


@pytest.mark.parametrize("size", [100 * 1024, 1000 * 1024])
def test_upload_sent_in_one_write_is_served(edge_server: ServerProcess, size: int) -> None:
    content = jsonl_of(size)
    for _ in range(5):
        with connect(edge_server) as sock:
            sock.sendall(upload_request(edge_server, content))
            answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_uploads_through_httpx_are_served(edge_server: ServerProcess) -> None:
    with edge_server.client() as client:
        for kib in range(64, 257, 8):
            uploaded = client.post(
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": ("input.jsonl", jsonl_of(kib * 1024), "application/jsonl")},
            )
            assert uploaded.status_code == 200, (kib, uploaded.text[:300])


# ---- connections that send bytes but no request ----------------------------------------------


def answer_of(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length body, leaving the connection open."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        assert chunk, answer
        answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    length = int(
        next(
            v
            for n, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:])
            if n.lower() == b"content-length"
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, answer
        body += chunk
    return head + b"\r\n\r\n" + body


def drip_until_closed(sock: socket.socket, byte: bytes, most: int) -> tuple[int, bytes]:
    """Send ``byte`` every 0.25 s, at most ``most`` times, until the server answers; then read
    to the end. Returns the bytes dripped and the answer."""
    sent = 0
    try:
        while sent < most:
            readable, _, _ = select.select([sock], [], [], 0.25)
            if readable:
                break
            sock.sendall(byte)
            sent += 1
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent, read_until_closed(sock)


def test_bytes_that_begin_no_request_do_not_hold_a_connection(edge_server: ServerProcess) -> None:
    # The parser skips a bare CRLF between requests without beginning one; such bytes still end
    # the keep-alive wait, so the head deadline takes over from the first of them.
    with connect(edge_server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer_of(sock).startswith(b"HTTP/1.1 200")
        dripped, answer = drip_until_closed(sock, b"\r\n", 200)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"header_timeout_s" in answer
    assert dripped < 100


def test_bytes_after_an_unsupported_upgrade_do_not_hold_a_connection(
    edge_server: ServerProcess,
) -> None:
    with connect(edge_server) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        )
        assert answer_of(sock).startswith(b"HTTP/1.1 200")
        dripped, answer = drip_until_closed(sock, b"\r\n", 200)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert dripped < 100


def test_websocket_upgrade_is_answered_as_plain_http(edge_server: ServerProcess) -> None:
    # Backfill has no WebSocket routes: the request reaches the API as an HTTP request.
    with connect(edge_server) as sock:
        sock.sendall(
            b"GET /v1/files HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        exchange = Exchange(0, answer_of(sock))
    assert exchange.status == 401, exchange.answer[:300]
    assert exchange.error()["code"] == "missing_api_key"


# ---- bodies the route does not read, and slow bodies -----------------------------------------


def test_answer_before_the_body_closes_the_connection(edge_server: ServerProcess) -> None:
    # The upload authenticates before it reads the body; the rest of a body dripped a byte
    # inside every idle timeout must not keep the connection.
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bf-wrong\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n"
    )
    with connect(edge_server) as sock:
        sock.sendall(head + b"-")
        answer = answer_of(sock)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
        assert b"\r\nconnection: close\r\n" in answer.lower()
        dripped, rest = drip_until_closed(sock, b"-", 200)
    assert rest == b""
    assert dripped < 100


def test_slow_json_body_gets_408_within_the_body_timeout(edge_server: ServerProcess) -> None:
    # Every byte comes inside body_idle_timeout_s; the whole body may still take no longer.
    head = (
        f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {edge_server.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    with connect(edge_server) as sock:
        sock.sendall(head + b"{")
        dripped, answer = drip_until_closed(sock, b" ", 200)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"body_idle_timeout_s" in answer
    assert dripped < 100
    with edge_server.client() as client:
        assert client.get("/healthz").status_code == 200


# ---- a refused pipelined request ------------------------------------------------------------


def test_refused_pipelined_head_does_not_break_into_the_answer_before_it(
    edge_server: ServerProcess,
) -> None:
    with connect(edge_server) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
        )
        answer = read_until_closed(sock)
    # The first request is answered whole, then the connection ends instead of a 431.
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert answer.endswith(b'{"status":"ok"}'), answer[-300:]
    assert answer.count(b"HTTP/1.1") == 1


def test_the_date_header_is_current_after_the_server_sat_idle(edge_server: ServerProcess) -> None:
    # The server has no timer for it: each request makes the header of its own second.
    with httpx.Client(base_url=edge_server.base_url) as client:
        for pause_s in (0.0, 2.5):
            time.sleep(pause_s)
            before = int(time.time())
            answer = client.get("/healthz")
            after = time.time()
            sent = parsedate_to_datetime(answer.headers["date"]).timestamp()
            assert before <= sent <= after, (answer.headers["date"], before, after)
            assert len(answer.headers.get_list("date")) == 1
