"""A 1,000,000-request file: upload + validation + batch creation time, and the server's peak
RSS, for plain JSONL and for the same requests as BatchRouter sectioned JSONL.

    PYTHONPATH=. python -m bench.accept_1m [--lines 1000000] [--format both|plain|sectioned]

The baseline is the time to send the same bytes over local HTTP to a socket that reads and
discards them, so the ratio shows what validation, encryption and storage add on top of moving
the bytes. Each format runs on a
fresh server, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.common import (
    MODEL,
    create_batch,
    multipart,
    peak_rss_mb,
    sim_config,
    start_backfill,
    stop,
    upload,
    wait_queued,
)

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
SECTION_REQUESTS = 1000


def plain_lines(count: int) -> Iterator[bytes]:
    for i in range(count):
        body = {
            "model": MODEL,
            "messages": [SYSTEM, {"role": "user", "content": f"Hi {i}"}],
            "max_tokens": 16,
        }
        line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
        yield orjson.dumps({**line, "body": body}) + b"\n"


def sectioned_lines(count: int) -> Iterator[bytes]:
    """The same requests, a section (shared model, limit and system prompt) per thousand."""
    yield orjson.dumps({"format": "batchrouter.sectioned.v1"}) + b"\n"
    for i in range(count):
        if i % SECTION_REQUESTS == 0:
            section = {
                "id": f"s{i // SECTION_REQUESTS}",
                "body": {"model": MODEL, "max_tokens": 16},
                "messages": [SYSTEM],
            }
            yield orjson.dumps({"section": section}) + b"\n"
        body = {"messages": [{"role": "user", "content": f"Hi {i}"}]}
        yield orjson.dumps({"custom_id": f"r{i}", "body": body}) + b"\n"


@dataclass(frozen=True)
class Measured:
    name: str
    mib: float
    transfer_s: float
    upload_s: float
    total_s: float
    queued_s: float
    rss_before: float
    rss: float


class Sink:
    """An HTTP endpoint on 127.0.0.1 that reads a chunked request body, drops it, answers 200."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self._server.accept()
            with conn:
                tail = b""
                while not tail.endswith(b"0\r\n\r\n"):
                    data = conn.recv(1 << 20)
                    if not data:
                        break
                    tail = (tail + data)[-5:]
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def measure(name: str, lines: Iterator[bytes], work: Path, sink: Sink) -> Measured:
    source = work / f"{name}.jsonl"
    with source.open("wb") as out:
        out.writelines(lines)
    # No engine is needed: the batch is only accepted. An unreachable URL keeps it queued.
    config = sim_config(work / f"{name}.toml", "http://127.0.0.1:9/v1", 1)
    process, base, key = start_backfill(config, work / f"data-{name}", work / f"{name}.log")
    try:
        client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900
        )
        body, content_type = multipart(source)
        start = time.perf_counter()
        moved = httpx.post(sink.url, content=body, headers={"Content-Type": content_type})
        transfer = time.perf_counter() - start
        assert moved.status_code == 200, moved.status_code
        rss_before = peak_rss_mb(process.pid)
        start = time.perf_counter()
        file_id = upload(client, source)
        upload_s = time.perf_counter() - start
        batch = create_batch(client, file_id)
        total_s = time.perf_counter() - start
        wait_queued(client, batch)
        queued_s = time.perf_counter() - start
        rss = peak_rss_mb(process.pid)
    finally:
        stop(process)
    mib = source.stat().st_size / (1 << 20)
    source.unlink()
    return Measured(name, mib, transfer, upload_s, total_s, queued_s, rss_before, rss)


def report(m: Measured, lines: int) -> None:
    print(f"{m.name}: {lines} requests, {m.mib:.0f} MiB")
    print(f"  send the bytes only    : {m.transfer_s:6.1f} s  1.00x")
    print(f"  upload + validation    : {m.upload_s:6.1f} s  {m.transfer_s / m.upload_s:.2f}x")
    print(
        f"    + batch creation     : {m.total_s:6.1f} s  (target <= 60 s: "
        f"{'met' if m.total_s <= 60 else 'MISSED'}), the answer"
    )
    print(f"    + every line queued  : {m.queued_s:6.1f} s  (in_progress)")
    print(
        f"  server peak RSS        : {m.rss:6.0f} MB (before the upload {m.rss_before:.0f} MB; "
        f"target <= 300 MB: {'met' if m.rss <= 300 else 'MISSED'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--format", choices=["both", "plain", "sectioned"], default="both")
    args = parser.parse_args()
    results: list[Measured] = []
    sink = Sink()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.format in ("both", "plain"):
            results.append(measure("plain", plain_lines(args.lines), work, sink))
        if args.format in ("both", "sectioned"):
            results.append(measure("sectioned", sectioned_lines(args.lines), work, sink))
    for m in results:
        report(m, args.lines)
    if len(results) == 2:
        plain, sectioned = results
        print(
            f"sectioned vs plain: time to in_progress {sectioned.queued_s / plain.queued_s:.2f}x, "
            f"peak RSS {sectioned.rss / plain.rss:.2f}x, bytes sent "
            f"{sectioned.mib / plain.mib:.2f}x"
        )


if __name__ == "__main__":
    main()
