"""``BlobStore`` that encrypts everything it writes to a raw store (SPEC §10.2)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from cryptography.exceptions import InvalidTag

from backfill.adapters.blobs.crypto import (
    HEADER,
    TAG,
    BlobKey,
    Keyring,
    header_version,
    plaintext_size,
    segment_nonce,
)
from backfill.adapters.blobs.raw import RawStore, RawWriter
from backfill.errors import ContentUnreadable, NotFound
from backfill.ports import BlobWriter

_CACHE_SEGMENTS = 16

log = logging.getLogger("backfill.blobs")


class _EncryptingWriter:
    def __init__(self, raw: RawWriter, key: BlobKey, header: bytes) -> None:
        self._raw = raw
        self._key = key
        self._header: bytes | None = header
        self._pending = bytearray()
        self._index = 0
        self._size = 0

    async def _put(self, data: bytes) -> None:
        if self._header is not None:
            data = self._header + data
            self._header = None
        await self._raw.write(data)

    async def write(self, data: bytes) -> None:
        self._pending += data
        self._size += len(data)
        seg = self._key.segment
        # Keep at least one byte back so the final segment is always written by commit().
        while len(self._pending) > seg:
            chunk = bytes(self._pending[:seg])
            del self._pending[:seg]
            nonce = segment_nonce(self._key, self._index, last=False)
            await self._put(self._key.cipher.encrypt(nonce, chunk, self._key.aad))
            self._index += 1

    async def commit(self) -> int:
        nonce = segment_nonce(self._key, self._index, last=True)
        await self._put(self._key.cipher.encrypt(nonce, bytes(self._pending), self._key.aad))
        self._pending.clear()
        await self._raw.commit()
        return self._size

    async def abort(self) -> None:
        await self._raw.abort()


class EncryptedBlobStore:
    """Per-blob data keys wrapped by the master key; range reads decrypt touched segments.

    Content that is missing, damaged or sealed under another key raises ``ContentUnreadable``
    (no retry can help); the raw store's ``StorageError`` for an outage passes through.
    ``legacy_reads`` allows format-1 blobs, which are not bound to their key: only while the
    database says some may remain (``keyring.min_blob_format`` = 1).

    Every such finding is logged with the blob's key (which names its file) and passed to
    ``on_damage`` by kind: ``missing``, ``truncated`` (no whole blob has its size), ``header``
    (the data key does not unwrap: damaged, another file's, or another master key) or
    ``segment`` (a segment fails its tag).
    """

    def __init__(
        self,
        raw: RawStore,
        keyring: Keyring,
        *,
        legacy_reads: bool = False,
        on_damage: Callable[[str], None] | None = None,
    ) -> None:
        self._raw = raw
        self._keyring = keyring
        self.legacy_reads = legacy_reads
        self._on_damage = on_damage
        # Opened blobs: (data key, plaintext size, segments, stored size), by key.
        self._keys: OrderedDict[str, tuple[BlobKey, int, int, int]] = OrderedDict()
        self._segments: OrderedDict[tuple[str, int], bytes] = OrderedDict()

    async def writer(self, key: str) -> BlobWriter:
        self._forget(key)
        header, blob_key = self._keyring.new_header(key)
        return _EncryptingWriter(await self._raw.writer(key), blob_key, header)

    async def opens(self, key: str) -> bool | None:
        """Whether the master key unwraps the data key of ``key`` (None: nothing stored there).

        Format 1 counts: this asks "was it written with our key", not "may it be read".
        """
        try:
            header = await self._raw.read(key, 0, HEADER)
        except NotFound:
            return None
        try:
            self._keyring.parse_header(header, key, legacy=True)
        except (ValueError, InvalidTag):
            return False
        return True

    async def _open(self, key: str) -> tuple[BlobKey, int, int, int]:
        cached = self._keys.get(key)
        if cached is not None:
            self._keys.move_to_end(key)
            return cached
        try:
            raw_size = await self._raw.size(key)
            header = await self._raw.read(key, 0, HEADER)
        except NotFound:
            raise self._damaged(key, "missing", f"Stored content {key!r} is missing.") from None
        try:
            blob_key = self._keyring.parse_header(header, key, legacy=self.legacy_reads)
        except (ValueError, InvalidTag):
            raise self._damaged(
                key,
                "header",
                f"Stored content {key!r} is damaged, belongs to another file, or was written "
                "with another master key.",
            ) from None
        try:
            size, count = plaintext_size(raw_size, blob_key.segment)
        except ValueError:
            raise self._damaged(
                key, "truncated", f"Stored content {key!r} is damaged (truncated)."
            ) from None
        entry = (blob_key, size, count, raw_size)
        self._keys[key] = entry
        if len(self._keys) > 256:
            self._keys.popitem(last=False)
        return entry

    async def _segment(self, key: str, blob_key: BlobKey, index: int, count: int) -> bytes:
        cached = self._segments.get((key, index))
        if cached is not None:
            self._segments.move_to_end((key, index))
            return cached
        span = blob_key.segment + TAG
        try:
            data = await self._raw.read(key, HEADER + index * span, span)
        except NotFound:
            raise self._damaged(key, "missing", f"Stored content {key!r} is missing.") from None
        nonce = segment_nonce(blob_key, index, last=index == count - 1)
        try:
            plain = blob_key.cipher.decrypt(nonce, data, blob_key.aad)
        except InvalidTag:
            # Also a blob cut short or replaced since it was opened: its segment reads short.
            raise self._damaged(
                key, "segment", f"Stored content {key!r} is damaged (segment {index})."
            ) from None
        self._segments[(key, index)] = plain
        if len(self._segments) > _CACHE_SEGMENTS:
            self._segments.popitem(last=False)
        return plain

    def _damaged(self, key: str, kind: str, message: str) -> ContentUnreadable:
        """Log and count what was found, and the error to raise; the key, never content."""
        # Forget what was cached of it: the next read looks at storage again (a restored blob
        # is then served without a restart).
        self._forget(key)
        log.error(
            "stored content unreadable: key=%s kind=%s; restore the file from a backup",
            key,
            kind,
        )
        if self._on_damage is not None:
            self._on_damage(kind)
        return ContentUnreadable(message)

    async def size(self, key: str) -> int:
        """The plaintext size, from what is stored now: a blob whose stored size changed since
        it was opened (cut short, or restored from a backup) is opened again, not served from
        what was cached of it."""
        cached = self._keys.get(key)
        if cached is not None:
            try:
                stored = await self._raw.size(key)
            except NotFound:
                stored = None
            if stored != cached[3]:
                self._forget(key)
        return (await self._open(key))[1]

    async def exists(self, key: str) -> bool:
        try:
            await self._raw.size(key)
        except NotFound:
            return False
        return True

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return b"".join([part async for part in self.stream(key, start, end)])

    async def stream(
        self, key: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        blob_key, size, count, _ = await self._open(key)
        end = size if end is None else min(end, size)
        seg = blob_key.segment
        position = start
        while position < end:
            index = position // seg
            plain = await self._segment(key, blob_key, index, count)
            lo = position - index * seg
            hi = min(len(plain), end - index * seg)
            yield plain[lo:hi]
            position = index * seg + hi

    async def reencrypt(self, key: str) -> bool:
        """Rewrite a format-1 blob as format 2 under the same key; False when there is nothing
        to do (already format 2, or no blob). The rewrite replaces the blob atomically."""
        try:
            version = header_version(await self._raw.read(key, 0, HEADER))
        except NotFound:
            return False
        if version != 1:
            return False
        old = EncryptedBlobStore(self._raw, self._keyring, legacy_reads=True)
        writer = await self.writer(key)
        try:
            async for part in old.stream(key):
                await writer.write(part)
        except BaseException:
            await writer.abort()
            raise
        await writer.commit()
        self._forget(key)
        return True

    async def delete(self, key: str) -> None:
        self._forget(key)
        await self._raw.delete(key)

    async def close(self) -> None:
        await self._raw.close()

    def _forget(self, key: str) -> None:
        self._keys.pop(key, None)
        for cached in [k for k in self._segments if k[0] == key]:
            del self._segments[cached]
