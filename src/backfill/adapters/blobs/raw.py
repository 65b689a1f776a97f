"""Byte stores without encryption: a local directory and an in-memory one for unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Protocol

from backfill.adapters.private import create_private, fsync_dir, private_dir
from backfill.errors import NotFound, StorageError

# A partial write untouched this long belongs to a process that is gone.
_STALE_PARTIAL_S = 3600.0


class RawWriter(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def commit(self) -> None: ...

    async def abort(self) -> None: ...


class RawStore(Protocol):
    async def writer(self, key: str) -> RawWriter: ...

    async def read(self, key: str, start: int, length: int) -> bytes: ...

    async def size(self, key: str) -> int: ...

    async def delete(self, key: str) -> None: ...

    async def close(self) -> None: ...


class _LocalWriter:
    def __init__(self, tmp: Path, final: Path) -> None:
        self._tmp = tmp
        self._final = final
        self._fh = os.fdopen(create_private(tmp), "wb")

    async def write(self, data: bytes) -> None:
        try:
            self._fh.write(data)
        except OSError as exc:
            await self.abort()
            raise StorageError(f"Could not store the file: {exc.strerror}.") from None

    async def commit(self) -> None:
        try:
            await asyncio.to_thread(self._sync_commit)
        except OSError as exc:
            await self.abort()
            raise StorageError(f"Could not store the file: {exc.strerror}.") from None

    def _sync_commit(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if not self._final.parent.is_dir():
            private_dir(self._final.parent)
        os.replace(self._tmp, self._final)
        fsync_dir(self._final.parent)

    async def abort(self) -> None:
        # Closing flushes buffered bytes, which fails again on a full disk: ignore that.
        with contextlib.suppress(OSError):
            self._fh.close()
        self._tmp.unlink(missing_ok=True)


class LocalRawStore:
    """Blobs as files under one directory; writes land atomically by rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / ".tmp"
        private_dir(root)
        private_dir(self._tmp)
        # Partial writes of a process that died are garbage: nobody can reference them. Only
        # stale ones: other processes sharing this directory (an API beside its workers) may
        # be writing theirs right now, and a write in progress touches its file.
        stale = time.time() - _STALE_PARTIAL_S
        for leftover in self._tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if leftover.stat().st_mtime < stale:
                    leftover.unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        if ".." in key.split("/") or key.startswith("/"):
            raise ValueError(f"bad blob key {key!r}")
        return self.root / key

    async def writer(self, key: str) -> RawWriter:
        try:
            return _LocalWriter(self._tmp / uuid.uuid4().hex, self._path(key))
        except OSError as exc:
            raise StorageError(f"Could not store the file: {exc.strerror}.") from None

    async def read(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except FileNotFoundError:
            raise NotFound(f"No content stored under {key!r}.") from None
        except OSError as exc:
            raise StorageError(f"Could not read stored content: {exc.strerror}.") from None

    async def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"No content stored under {key!r}.") from None
        except OSError as exc:
            raise StorageError(f"Could not read stored content: {exc.strerror}.") from None

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    async def close(self) -> None:
        return None


class _MemoryWriter:
    def __init__(self, store: MemoryRawStore, key: str) -> None:
        self._store = store
        self._key = key
        self._parts: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self._parts.append(bytes(data))

    async def commit(self) -> None:
        self._store.blobs[self._key] = b"".join(self._parts)

    async def abort(self) -> None:
        self._parts.clear()


class MemoryRawStore:
    """In-memory blobs for unit tests; passes the same contract tests as the local store."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    async def writer(self, key: str) -> RawWriter:
        return _MemoryWriter(self, key)

    async def read(self, key: str, start: int, length: int) -> bytes:
        try:
            return self.blobs[key][start : start + length]
        except KeyError:
            raise NotFound(f"No content stored under {key!r}.") from None

    async def size(self, key: str) -> int:
        try:
            return len(self.blobs[key])
        except KeyError:
            raise NotFound(f"No content stored under {key!r}.") from None

    async def delete(self, key: str) -> None:
        self.blobs.pop(key, None)

    async def close(self) -> None:
        return None
