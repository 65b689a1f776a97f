"""Storage that fails during an upload (SPEC §3.1 "nothing is stored", §10.2, §12).

(a) The local blob store's files fail the way a full or broken disk does: ``write`` raises
    ``OSError(ENOSPC)`` once a byte budget is spent, or ``flush`` (the commit) raises
    ``OSError(EIO)``. The upload must answer an OpenAI envelope (503 ``storage_unavailable``,
    ``x-should-retry: true``), leave no visible file and no stored bytes, and the server must
    keep serving: once the disk has room again, the next upload works.
(b) The same against a real, tiny tmpfs mounted for the test (where mounting is not allowed:
    a failure in CI, a loud skip elsewhere).
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest

from backfill.adapters.blobs.raw import LocalRawStore, RawWriter
from backfill.simulator.server import Simulator
from tests.support import (
    InProcess,
    backfill_on_raw_store,
    chat_line,
    in_process_backfill,
    jsonl,
    tmpfs,
)

Sim = tuple[str, Simulator]

# About 700 KB: many encrypted segments, so a budget can run out at the start, in the middle,
# or in the index blob.
BIG = jsonl([chat_line(f"big-{i:05d}", "lorem ipsum " * 40) for i in range(1200)])
SMALL = jsonl([chat_line("small-1", "after the outage")])


@dataclass
class Disk:
    """What the faulty files share: bytes left before ENOSPC, and which flush fails."""

    budget: int | None = None
    fail_flush: int | None = None
    flushes: int = 0
    failures: int = 0

    def heal(self) -> None:
        self.budget = None
        self.fail_flush = None


class _FaultyFile:
    """A binary file whose writes and flushes fail like a full or broken disk."""

    def __init__(self, fh: BinaryIO, disk: Disk) -> None:
        self._fh = fh
        self._disk = disk

    def write(self, data: bytes) -> int:
        disk = self._disk
        if disk.budget is not None and len(data) > disk.budget:
            fits = disk.budget
            self._fh.write(data[:fits])  # a short write, then the disk is full
            disk.budget = 0
            disk.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if disk.budget is not None:
            disk.budget -= len(data)
        return self._fh.write(data)

    def flush(self) -> None:
        disk = self._disk
        disk.flushes += 1
        if disk.fail_flush is not None and disk.flushes == disk.fail_flush:
            disk.failures += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    def close(self) -> None:
        self._fh.close()


class FaultyRawStore(LocalRawStore):
    def __init__(self, root: Path, disk: Disk) -> None:
        super().__init__(root)
        self.disk = disk

    async def writer(self, key: str) -> RawWriter:
        writer = await super().writer(key)
        # The local writer's file handle is where a real disk error surfaces: wrap it there so
        # the store's own error handling is what is under test.
        vars(writer)["_fh"] = _FaultyFile(vars(writer)["_fh"], self.disk)
        return writer


@asynccontextmanager
async def faulty_backfill(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch, disk: Disk
) -> AsyncIterator[InProcess]:
    def make(root: Path) -> FaultyRawStore:
        return FaultyRawStore(root, disk)

    async with backfill_on_raw_store(tmp_path, sim[0], monkeypatch, make) as (running, _):
        yield running


def assert_storage_error(response: httpx.Response) -> None:
    assert 500 <= response.status_code < 600, response.text
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert error["code"] == "storage_unavailable", error
    assert error["type"] == "server_error", error
    assert response.status_code == 503, response.text
    assert response.headers["x-should-retry"] == "true"


async def assert_nothing_visible(bf: InProcess, root: Path) -> None:
    listed = await bf.client.get("/v1/files")
    assert listed.status_code == 200, listed.text
    assert listed.json()["data"] == [], "a failed upload is listed"
    stored = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert stored == [], f"a failed upload left bytes behind: {stored}"


async def assert_serves_again(bf: InProcess) -> None:
    response = await bf.upload(SMALL)
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    listed = (await bf.client.get("/v1/files")).json()["data"]
    assert [f["id"] for f in listed] == [file_id]
    content = await bf.client.get(f"/v1/files/{file_id}/content")
    assert content.content == SMALL


# ---- (a) a faulty blob adapter ---------------------------------------------------------------


@pytest.mark.parametrize(
    "budget",
    [0, 100, 4096, 300_000, len(BIG) + 20_000],
    ids=["first-byte", "header", "first-segment", "middle", "index-blob"],
)
async def test_disk_full_during_upload(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    disk = Disk(budget=budget)
    async with faulty_backfill(tmp_path, sim, monkeypatch, disk) as bf:
        response = await bf.upload(BIG)
        assert disk.failures >= 1, "the fault was never hit; make BIG larger"
        assert_storage_error(response)
        await assert_nothing_visible(bf, bf.settings.resolved_storage_path)
        # Still full: uploads keep failing cleanly, reads keep working.
        assert_storage_error(await bf.upload(SMALL))
        assert (await bf.client.get("/v1/models")).status_code == 200
        await assert_nothing_visible(bf, bf.settings.resolved_storage_path)
        disk.heal()
        await assert_serves_again(bf)


@pytest.mark.parametrize("flush", [1, 2], ids=["content-commit", "index-commit"])
async def test_commit_fails(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch, flush: int
) -> None:
    """The final flush of the content blob, or of the index blob, raises EIO."""
    disk = Disk(fail_flush=flush)
    async with faulty_backfill(tmp_path, sim, monkeypatch, disk) as bf:
        response = await bf.upload(BIG)
        assert disk.failures == 1
        assert_storage_error(response)
        await assert_nothing_visible(bf, bf.settings.resolved_storage_path)
        disk.heal()
        await assert_serves_again(bf)


# ---- (b) a real, tiny filesystem -------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "tiny-fs", "2m") as mount_point:
        yield mount_point


async def test_real_full_filesystem(tmp_path: Path, sim: Sim, tiny_fs: Path) -> None:
    big = jsonl([chat_line(f"fs-{i:05d}", "lorem ipsum " * 40) for i in range(6000)])  # 3.5 MB
    async with in_process_backfill(tmp_path, sim[0], storage_url=f"file://{tiny_fs}") as bf:
        response = await bf.upload(big)
        assert_storage_error(response)
        await assert_nothing_visible(bf, tiny_fs)
        await assert_serves_again(bf)
