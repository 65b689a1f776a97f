"""A 1,000,000-request batch end to end on the simulator (tiny outputs): accepting it, draining
it, finalizing it and downloading its output, each phase with its time and the server's peak
RSS over that phase, and Backfill's CPU per 1,000 requests over the whole run.

    PYTHONPATH=. python -m bench.million [--lines 1000000] [--concurrency 128]

Accepting ends with the creation's answer (``validating``: a batch this large is queued in the
background); the time until every line is queued (``in_progress``) is reported beside it.
Baselines measured in the same run: the upload against a socket that reads and drops the same
bytes, and the download against a socket that sends the output file's bytes as they are (both
over local HTTP, the download read by a client that drops what it reads), so the ratios show
what Backfill adds on top of moving the bytes. The peak RSS of a phase is the process's
high-water mark, reset (``/proc/PID/clear_refs``) as it starts.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.accept_1m import Sink, plain_lines
from bench.common import (
    cpu_seconds,
    create_batch,
    multipart,
    peak_rss_mb,
    sim_config,
    start_backfill,
    start_simulator,
    stop,
    upload,
    wait_queued,
)

# Targets of the performance issue's fourth item.
ACCEPT_S, ACCEPT_MB = 6.0, 200.0
FINALIZE_S, FINALIZE_MB = 20.0, 300.0
DOWNLOAD_MBPS = 200.0
CPU_PER_1K = 0.20 * 1.10


def reset_peak(pid: int) -> None:
    """Start the process's RSS high-water mark over from its current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Source:
    """An HTTP endpoint on 127.0.0.1 that answers every request with one file's bytes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self._server.accept()
            with conn:
                conn.recv(1 << 16)
                size = self._path.stat().st_size
                conn.sendall(
                    f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n"
                    "Connection: close\r\n\r\n".encode()
                )
                with self._path.open("rb") as fh:
                    conn.sendfile(fh)


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[float, int]:
    """Seconds and bytes to read ``url``'s body into a reused buffer (dropped): a client that
    costs next to nothing, so the figure is the server's."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=900)
    buffer = bytearray(1 << 20)
    size = 0
    start = time.perf_counter()
    conn.request("GET", parts.path, headers=headers or {})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"GET {url}: {response.status}")
    while read := response.readinto(buffer):
        size += read
    took = time.perf_counter() - start
    conn.close()
    return took, size


@dataclass
class Phase:
    name: str
    seconds: float
    peak_mb: float
    baseline_s: float = 0.0


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run(lines: int, concurrency: int, work: Path) -> None:
    source = work / "input.jsonl"
    with source.open("wb") as out:
        out.writelines(plain_lines(lines))
    mib = source.stat().st_size / (1 << 20)
    engine, engine_url = start_simulator("--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "2")
    config = sim_config(work / "million.toml", engine_url, concurrency)
    process, base, key = start_backfill(config, work / "data", work / "server.log")
    phases: list[Phase] = []
    try:
        client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900
        )
        sink = Sink()
        body, content_type = multipart(source)
        start = time.perf_counter()
        httpx.post(sink.url, content=body, headers={"Content-Type": content_type})
        sent_s = time.perf_counter() - start

        cpu_start = cpu_seconds(process.pid)
        reset_peak(process.pid)
        start = time.perf_counter()
        batch = create_batch(client, upload(client, source))
        phases.append(
            Phase("accept", time.perf_counter() - start, peak_rss_mb(process.pid), sent_s)
        )
        batch = wait_queued(client, batch)
        phases.append(Phase("queue", time.perf_counter() - start, peak_rss_mb(process.pid)))

        reset_peak(process.pid)
        start = time.perf_counter()
        while batch["status"] not in ("finalizing", "completed", "failed", "cancelled"):
            time.sleep(0.05)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        drained = time.perf_counter()
        phases.append(Phase("drain", drained - start, peak_rss_mb(process.pid)))

        reset_peak(process.pid)
        while batch["status"] == "finalizing":
            time.sleep(0.05)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        phases.append(Phase("finalize", time.perf_counter() - drained, peak_rss_mb(process.pid)))
        counts = batch["request_counts"]
        if batch["status"] != "completed" or counts["completed"] != lines:
            raise RuntimeError(f"batch ended {batch['status']} with {counts}")

        reset_peak(process.pid)
        content = f"{base}/v1/files/{batch['output_file_id']}/content"
        took, size = fetch(content, {"Authorization": f"Bearer {key}"})
        # The same bytes, served from a plain file by a bare socket.
        output = work / "output.jsonl"
        with client.stream("GET", content) as response, output.open("wb") as out:
            for data in response.iter_raw(1 << 20):
                out.write(data)
        bare_s, bare_size = fetch(Source(output).url)
        assert bare_size == size, (bare_size, size)
        phases.append(Phase("download", took, peak_rss_mb(process.pid), bare_s))
        cpu = cpu_seconds(process.pid) - cpu_start
    finally:
        stop(process)
        stop(engine)

    accept, queue, drain, finalize, served = phases
    out_mb = size / 1e6
    print(f"{lines} requests, {mib:.0f} MiB in, {out_mb:.0f} MB out, concurrency {concurrency}")
    print(
        f"  accept (upload + validation + creation): {accept.seconds:6.1f} s  "
        f"({accept.baseline_s / accept.seconds:.2f}x sending the bytes only, "
        f"{accept.baseline_s:.1f} s), peak RSS {accept.peak_mb:.0f} MB  "
        f"target <= {ACCEPT_S:.0f} s: {verdict(accept.seconds <= ACCEPT_S)}, "
        f"<= {ACCEPT_MB:.0f} MB: {verdict(accept.peak_mb <= ACCEPT_MB)}"
    )
    print(
        f"  every line queued (in_progress): {queue.seconds:6.1f} s from the upload's start, "
        f"peak RSS {queue.peak_mb:.0f} MB"
    )
    print(
        f"  drain: {drain.seconds:6.1f} s  {lines / drain.seconds:.0f} req/s, "
        f"peak RSS {drain.peak_mb:.0f} MB"
    )
    print(
        f"  finalize: {finalize.seconds:6.1f} s, peak RSS {finalize.peak_mb:.0f} MB  "
        f"target <= {FINALIZE_S:.0f} s: {verdict(finalize.seconds <= FINALIZE_S)}, "
        f"<= {FINALIZE_MB:.0f} MB: {verdict(finalize.peak_mb <= FINALIZE_MB)}"
    )
    speed, bare = out_mb / served.seconds, out_mb / served.baseline_s
    print(
        f"  download: {served.seconds:6.2f} s  {speed:.0f} MB/s "
        f"({served.baseline_s / served.seconds:.2f}x a bare socket's {bare:.0f} MB/s), "
        f"peak RSS {served.peak_mb:.0f} MB  "
        f"target >= {DOWNLOAD_MBPS:.0f} MB/s: {verdict(speed >= DOWNLOAD_MBPS)}"
    )
    per_1k = cpu / lines * 1000
    print(
        f"  Backfill CPU over the whole run: {cpu:.1f} s, {per_1k:.3f} s per 1,000 requests  "
        f"target <= {CPU_PER_1K:.2f} s: {verdict(per_1k <= CPU_PER_1K)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args.lines, args.concurrency, Path(tmp))


if __name__ == "__main__":
    main()
