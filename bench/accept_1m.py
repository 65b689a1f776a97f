"""A 1,000,000-line file: upload + validation + batch creation time, and the server's peak RSS.

    PYTHONPATH=. python -m bench.accept_1m [--lines 1000000]

The baseline is the time to send the same bytes to the same server and have them discarded
(a request to an unknown URL the server rejects after reading), so the ratio shows what
validation, encryption and creation add on top of moving the bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.common import MODEL, multipart, peak_rss_mb, sim_config, start_backfill, stop


def short_line(i: int) -> bytes:
    return (
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Hi {i}"}],
                    "max_tokens": 16,
                },
            }
        )
        + b"\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "input.jsonl"
        with source.open("wb") as out:
            for i in range(args.lines):
                out.write(short_line(i))
        size_mib = source.stat().st_size / (1 << 20)
        # No engine is needed: the batch is only accepted. An unreachable URL keeps it queued.
        config = sim_config(work / "bench.toml", "http://127.0.0.1:9/v1", 1)
        process, base, key = start_backfill(config, work / "data", work / "server.log")
        try:
            client = httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900
            )
            body, content_type = multipart(source)
            start = time.perf_counter()
            moved = client.post("/v1/nowhere", content=body, headers={"Content-Type": content_type})
            transfer = time.perf_counter() - start
            assert moved.status_code in (404, 405), moved.status_code
            rss_before = peak_rss_mb(process.pid)
            body, content_type = multipart(source)
            start = time.perf_counter()
            uploaded = client.post(
                "/v1/files", content=body, headers={"Content-Type": content_type}
            )
            uploaded.raise_for_status()
            upload_s = time.perf_counter() - start
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            created.raise_for_status()
            total_s = time.perf_counter() - start
            rss = peak_rss_mb(process.pid)
        finally:
            stop(process)
    print(f"file: {args.lines} lines, {size_mib:.0f} MiB")
    print(f"send the bytes only      : {transfer:6.1f} s  1.00x")
    print(f"upload + validation      : {upload_s:6.1f} s  {transfer / upload_s:.2f}x")
    print(
        f"  + batch creation       : {total_s:6.1f} s  (target <= 60 s: "
        f"{'met' if total_s <= 60 else 'MISSED'})"
    )
    print(
        f"server peak RSS          : {rss:6.0f} MB (before the upload {rss_before:.0f} MB; "
        f"target <= 300 MB: {'met' if rss <= 300 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
