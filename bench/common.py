"""Helpers the benchmarks share: input files, processes, timing. The process launcher (free_port,
wait_http, start_simulator, spawn_up, start_backfill, stop) is the tests' too."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

MODEL = "sim-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request_line(
    i: int, max_tokens: int = 64, model: str = MODEL, temperature: float = 0.2
) -> bytes:
    return (
        orjson.dumps(
            {
                "custom_id": f"request-{i:08d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": "You are a careful assistant."},
                        {
                            "role": "user",
                            "content": f"Summarize ticket {i}: the customer cannot "
                            "sign in after resetting the password twice.",
                        },
                    ],
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                },
            }
        )
        + b"\n"
    )


def short_line(i: int) -> bytes:
    """A request as small as a chat line gets: what per-line costs are measured with."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 16}
    line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return orjson.dumps(line) + b"\n"


def write_input(path: Path, lines: int, max_tokens: int = 64) -> int:
    with path.open("wb") as out:
        for i in range(lines):
            out.write(request_line(i, max_tokens))
    return path.stat().st_size


def sim_config(
    path: Path,
    sim_url: str,
    concurrency: int,
    extra: str = "",
    engine: str = "",
    modalities: tuple[str, ...] = ("text",),
) -> Path:
    """Settings for one simulated engine; ``extra`` top-level lines, ``engine`` more lines of
    the engine's table, ``modalities`` what the model takes."""
    path.write_text(
        f"""
local_engine = false
limits.max_unfinished_batches = 1000
{extra}

[[models]]
id = "{MODEL}"
model_config_id = "sim-model-v1"
context_length = 8192
max_output_tokens = 4096
modalities = {list(modalities)!r}
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}

[[engines]]
name = "sim"
base_url = "{sim_url}"
models = ["{MODEL}"]
max_concurrency = {concurrency}
request_timeout_s = 60
{engine}
"""
    )
    return path


def wait_http(
    url: str, process: subprocess.Popen[bytes] | None = None, timeout_s: float = 60
) -> None:
    """Wait until ``url`` answers below 500; fail early if ``process`` (what serves it) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def start_simulator(
    *args: str, host: str = "127.0.0.1", port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``backfill simulate`` on ``host`` at ``port`` (default: a free one) with ``args``, once
    it answers: (process, base URL ending in /v1). The tests start their simulator processes
    with it too."""
    port = port or free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            *("-m", "backfill.cli", "simulate"),
            *("--host", host, "--port", str(port)),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://{host}:{port}/health", process)
    return process, f"http://{host}:{port}/v1"


def spawn_up(config: Path, data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``backfill up`` with ``config`` and no local engine; its output is appended to ``log``
    (a restarted server keeps adding to the same one). The tests start servers with it too."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backfill.cli",
                "up",
                "--port",
                str(port),
                "--data",
                str(data),
                "--no-local-engine",
                "--config",
                str(config),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_backfill(config: Path, data: Path, log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """``backfill up`` on a free port, once it answers: (process, base URL, the API key it
    printed). The tests start their server processes with it too."""
    port = free_port()
    process = spawn_up(config, data, port, log)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", process)
    match = re.search(r"bf-[A-Za-z0-9_-]+", log.read_text())
    if match is None:
        raise RuntimeError(log.read_text())
    return process, base, match.group(0)


def own_cpu() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def multipart(path: Path, boundary: str = "backfillbench") -> tuple[Iterator[bytes], str]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()

    def body() -> Iterator[bytes]:
        yield head
        with path.open("rb") as fh:
            yield from iter(lambda: fh.read(1 << 20), b"")
        yield f"\r\n--{boundary}--\r\n".encode()

    return body(), f"multipart/form-data; boundary={boundary}"


def stop(process: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """Terminate ``process`` (if it still runs) and wait for it; kill it if it hangs."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def upload(client: httpx.Client, source: Path) -> str:
    """Upload ``source`` as a batch input file; its id."""
    body, content_type = multipart(source)
    uploaded = client.post("/v1/files", content=body, headers={"Content-Type": content_type})
    uploaded.raise_for_status()
    return str(uploaded.json()["id"])


def create_batch(client: httpx.Client, file_id: str) -> dict[str, Any]:
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    batch: dict[str, Any] = created.json()
    return batch


def wait_batch(
    client: httpx.Client,
    batch: dict[str, Any],
    poll_s: float = 0.1,
    *,
    fine_poll_s: float | None = None,
) -> dict[str, Any]:
    """Poll ``batch`` until it ends; the ended batch. With ``fine_poll_s``: every
    ``fine_poll_s`` once the batch's rate so far puts its end within one and a half polls, so
    the end is seen within ``fine_poll_s`` for a few more polls."""
    start = time.perf_counter()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        wait = poll_s
        counts = batch["request_counts"]
        ended = counts["completed"] + counts["failed"]
        if fine_poll_s is not None and ended:
            left_s = (counts["total"] - ended) * (time.perf_counter() - start) / ended
            if left_s <= 1.5 * poll_s:
                wait = fine_poll_s
        time.sleep(wait)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch


def wait_queued(client: httpx.Client, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll a batch that answered ``validating`` (a large one is queued in the background)
    until every line is queued; the batch, ``in_progress``."""
    while batch["status"] == "validating":
        time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    if batch["status"] != "in_progress":
        raise RuntimeError(f"the batch is {batch['status']}: {batch.get('errors')}")
    return batch
