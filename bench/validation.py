"""Validation speed vs a bare typed msgspec decode of the same lines (SPEC §5.8).

    PYTHONPATH=. python -m bench.validation [--mib 256]

Both sides read the same file in 1 MiB chunks from the page cache. The baseline splits lines
and decodes each into the typed ``RequestLine`` struct, nothing else. Backfill runs its upload
path: line splitting with limits, the typed decode, every rule of SPEC §5, and AES-GCM
encryption of the content into an in-memory store.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import msgspec

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import MemoryRawStore
from backfill.domain.catalog import CatalogModel
from backfill.domain.input_format import Limits, LineValidator, RequestLine
from backfill.domain.lines import LineSplitter
from backfill.domain.money import Prices
from backfill.services.files import FileService, Upload
from bench.common import MODEL, request_line

CHUNK = 1 << 20
LIMITS = Limits(max_file_bytes=1 << 40, max_lines=10**8, max_line_bytes=20 << 20)
CATALOG = {MODEL: CatalogModel(MODEL, "sim-model-v1", 8192, 4096, prices=Prices(1, 1, 1))}


def bare(path: Path) -> int:
    decoder = msgspec.json.Decoder(RequestLine)
    lines = 0
    rest = b""
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for line in parts:
                decoder.decode(line)
            lines += len(parts)
    return lines


def validator_only(path: Path) -> int:
    splitter = LineSplitter(LIMITS)
    validator = LineValidator(LIMITS, CATALOG.get)
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            first_line_no, lines = splitter.feed_lines(chunk)
            validator.check_lines(lines, first_line_no)
            splitter.raise_pending()
        first_line_no, lines = splitter.finish_lines()
        validator.check_lines(lines, first_line_no)
    return validator.lines


async def upload_path(path: Path) -> int:
    """The upload service's own code: validation, the line index, encryption to storage."""
    blobs = EncryptedBlobStore(MemoryRawStore(), Keyring(os.urandom(32)))
    service = cast(
        FileService, SimpleNamespace(limits=LIMITS, blobs=blobs, max_retained_input_bytes=None)
    )
    upload = Upload(
        service, "org", await blobs.writer("content"), await blobs.writer("index"), "f", CATALOG
    )
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            await upload.feed(chunk)
    await upload.abort()
    return 0


def timed(fn: Callable[[Path], object], path: Path) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        result = fn(path)
        if inspect.iscoroutine(result):
            asyncio.run(result)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.jsonl"
        lines = 0
        with path.open("wb") as out:
            while out.tell() < args.mib << 20:
                out.write(request_line(lines))
                lines += 1
        size = path.stat().st_size
        base = timed(bare, path)
        only = timed(validator_only, path)
        full = timed(upload_path, path)
    mib = size / (1 << 20)
    print(f"file: {mib:.0f} MiB, {lines} lines")
    print(f"bare msgspec typed decode : {base:6.2f} s  {mib / base:7.1f} MiB/s  1.00x")
    print(f"backfill validation       : {only:6.2f} s  {mib / only:7.1f} MiB/s  {base / only:.2f}x")
    print(f"upload path (+index, AES) : {full:6.2f} s  {mib / full:7.1f} MiB/s  {base / full:.2f}x")
    verdict = "met" if base / only >= 0.5 else "MISSED"
    print(f"target: validation >= 0.50x of the bare decode -> {verdict}")


if __name__ == "__main__":
    main()
