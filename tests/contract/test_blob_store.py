"""One contract for every ``BlobStore`` backend, plus encryption-at-rest checks (SPEC §10.2)."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag

from backfill.adapters.blobs.crypto import HEADER, SEGMENT, TAG, Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.master import load_master_key
from backfill.adapters.blobs.raw import LocalRawStore, MemoryRawStore, RawStore
from backfill.adapters.blobs.s3 import S3RawStore
from backfill.errors import ContentUnreadable
from backfill.ports import BlobStore
from tests.support import S3_CREDENTIALS, legacy_blob, moto_endpoint, new_bucket

KEY = "files/blob-under-test"
SIZES = [0, 1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT + 7]
# What a read of damaged ciphertext raises: never plaintext, never silence, never a retry.
DAMAGED = ContentUnreadable


@dataclass
class Backend:
    store: EncryptedBlobStore
    raw: RawStore
    """The stored bytes under the encryption, as someone with storage access sees them."""
    reopen: Callable[[], EncryptedBlobStore]
    """A fresh store over the same stored bytes (no caches), as another process would see it."""
    root: Path | None = None
    """Where the local backend keeps its files."""


def _memory(_: Path, keyring: Keyring) -> Backend:
    raw = MemoryRawStore()
    return Backend(EncryptedBlobStore(raw, keyring), raw, lambda: EncryptedBlobStore(raw, keyring))


def _local(tmp_path: Path, keyring: Keyring) -> Backend:
    root = tmp_path / "blobs"
    raw = LocalRawStore(root)
    return Backend(
        EncryptedBlobStore(raw, keyring),
        raw,
        lambda: EncryptedBlobStore(LocalRawStore(root), keyring),
        root,
    )


def _s3(_: Path, keyring: Keyring) -> Backend:
    url = f"s3://{new_bucket()}/blobs"

    def open_raw() -> S3RawStore:
        return S3RawStore(url, endpoint_url=moto_endpoint(), **S3_CREDENTIALS)

    def open_store() -> EncryptedBlobStore:
        return EncryptedBlobStore(open_raw(), keyring)

    return Backend(open_store(), open_raw(), open_store)


BACKENDS: dict[str, Callable[[Path, Keyring], Backend]] = {
    "memory": _memory,
    "local": _local,
    "s3": _s3,
}


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(os.urandom(32))


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path, keyring: Keyring) -> Backend:
    return BACKENDS[request.param](tmp_path, keyring)


@pytest.fixture
def blobs(backend: Backend) -> BlobStore:
    return backend.store


@pytest.fixture
def local(tmp_path: Path, keyring: Keyring) -> Backend:
    return _local(tmp_path, keyring)


async def put(store: BlobStore, key: str, data: bytes, chunk: int = 256 * 1024 + 3) -> int:
    """Write ``data`` in odd-sized chunks, so segment boundaries fall inside writes."""
    writer = await store.writer(key)
    for start in range(0, len(data), chunk):
        await writer.write(data[start : start + chunk])
    return await writer.commit()


async def collect(store: BlobStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join([part async for part in store.stream(key, start, end)])


def boundary_ranges(size: int) -> list[tuple[int, int | None]]:
    """Ranges that start, end or straddle every segment boundary of a ``size``-byte blob."""
    ranges: list[tuple[int, int | None]] = [(0, None), (0, size), (size, None)]
    for boundary in range(0, size + 1, SEGMENT):
        for start in (boundary - 1, boundary, boundary + 1):
            if 0 <= start <= size:
                ranges.append((start, None))
                for end in (boundary - 1, boundary, boundary + 1, start + 1, size):
                    if start <= end <= size:
                        ranges.append((start, end))
    return sorted(set(ranges), key=lambda r: (r[0], -1 if r[1] is None else r[1]))


# ---- the contract -----------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
async def test_round_trip(blobs: BlobStore, backend: Backend, size: int) -> None:
    data = os.urandom(size)
    assert await put(blobs, KEY, data) == size
    assert await blobs.size(KEY) == size
    assert await blobs.read(KEY) == data
    again = backend.reopen()
    assert await again.size(KEY) == size
    assert await again.read(KEY) == data


@pytest.mark.parametrize("size", [SEGMENT, 3 * SEGMENT + 7])
async def test_range_reads_at_every_segment_boundary(
    blobs: BlobStore, backend: Backend, size: int
) -> None:
    data = os.urandom(size)
    await put(blobs, KEY, data)
    fresh = backend.reopen()
    for start, end in boundary_ranges(size):
        expected = data[start:end]
        assert await blobs.read(KEY, start, end) == expected, (start, end)
        # A store with cold caches decrypts only what the range touches, and must agree.
        assert await fresh.read(KEY, start, end) == expected, (start, end)
        fresh = backend.reopen()


@pytest.mark.parametrize("size", [0, 1, SEGMENT + 1, 3 * SEGMENT + 7])
async def test_stream_equals_read(blobs: BlobStore, size: int) -> None:
    data = os.urandom(size)
    await put(blobs, KEY, data)
    assert await collect(blobs, KEY) == await blobs.read(KEY) == data
    for start, end in boundary_ranges(size):
        assert await collect(blobs, KEY, start, end) == await blobs.read(KEY, start, end)


async def test_stream_yields_bounded_chunks(blobs: BlobStore) -> None:
    await put(blobs, KEY, os.urandom(3 * SEGMENT + 7))
    parts = [part async for part in blobs.stream(KEY)]
    assert len(parts) >= 4
    assert all(0 < len(part) <= SEGMENT for part in parts)


async def test_range_end_past_the_blob_is_clamped(blobs: BlobStore) -> None:
    data = os.urandom(SEGMENT + 5)
    await put(blobs, KEY, data)
    assert await blobs.read(KEY, SEGMENT, 10 * SEGMENT) == data[SEGMENT:]


async def test_delete_then_read_raises_content_unreadable(
    blobs: BlobStore, backend: Backend
) -> None:
    await put(blobs, KEY, os.urandom(SEGMENT + 1))
    assert await blobs.read(KEY, 0, 10)  # warm any cache
    await blobs.delete(KEY)
    with pytest.raises(ContentUnreadable):
        await blobs.read(KEY)
    with pytest.raises(ContentUnreadable):
        await collect(blobs, KEY)
    with pytest.raises(ContentUnreadable):
        await blobs.size(KEY)
    with pytest.raises(ContentUnreadable):
        await backend.reopen().read(KEY)


async def test_missing_key_raises_content_unreadable(blobs: BlobStore) -> None:
    with pytest.raises(ContentUnreadable):
        await blobs.read("files/never-written")
    with pytest.raises(ContentUnreadable):
        await blobs.size("files/never-written")


async def test_delete_is_idempotent(blobs: BlobStore) -> None:
    await blobs.delete("files/never-written")
    await put(blobs, KEY, b"x")
    await blobs.delete(KEY)
    await blobs.delete(KEY)
    with pytest.raises(ContentUnreadable):
        await blobs.read(KEY)


async def test_abort_leaves_nothing(blobs: BlobStore, backend: Backend) -> None:
    writer = await blobs.writer(KEY)
    await writer.write(os.urandom(2 * SEGMENT + 3))
    await writer.abort()
    with pytest.raises(ContentUnreadable):
        await blobs.read(KEY)
    with pytest.raises(ContentUnreadable):
        await backend.reopen().size(KEY)
    if backend.root is not None:
        assert [p for p in backend.root.rglob("*") if p.is_file()] == []


async def test_uncommitted_write_is_invisible(blobs: BlobStore) -> None:
    writer = await blobs.writer(KEY)
    await writer.write(os.urandom(SEGMENT + 3))
    with pytest.raises(ContentUnreadable):
        await blobs.read(KEY)
    await writer.abort()


async def test_abort_keeps_the_previous_version(blobs: BlobStore) -> None:
    old = os.urandom(SEGMENT + 9)
    await put(blobs, KEY, old)
    writer = await blobs.writer(KEY)
    await writer.write(os.urandom(100))
    await writer.abort()
    assert await blobs.read(KEY) == old


async def test_overwrite_replaces_the_content(blobs: BlobStore, backend: Backend) -> None:
    first = os.urandom(2 * SEGMENT + 1)
    await put(blobs, KEY, first)
    assert await blobs.read(KEY) == first  # caches the first version's key and segments
    second = os.urandom(SEGMENT // 2)
    await put(blobs, KEY, second)
    assert await blobs.size(KEY) == len(second)
    assert await blobs.read(KEY) == second
    assert await backend.reopen().read(KEY) == second


async def test_keys_are_independent(blobs: BlobStore) -> None:
    a, b = os.urandom(SEGMENT + 1), os.urandom(77)
    await put(blobs, "files/a", a)
    await put(blobs, "files/a.index", b)
    await blobs.delete("files/a.index")
    assert await blobs.read("files/a") == a


# ---- binding to the storage key, and the old unbound format ------------------------------


async def copy_raw(raw: RawStore, source: str, target: str) -> None:
    """What an attacker with storage write access (and no master key) can do."""
    data = await raw.read(source, 0, await raw.size(source))
    writer = await raw.writer(target)
    await writer.write(data)
    await writer.commit()


async def put_legacy(raw: RawStore, master: bytes, key: str, data: bytes) -> None:
    """Write ``data`` in format 1 ("BFE1", not bound to its key), as releases before the
    binding did."""
    writer = await raw.writer(key)
    await writer.write(legacy_blob(master, data))
    await writer.commit()


@pytest.mark.parametrize("size", [0, 100, SEGMENT + 1])
async def test_a_blob_copied_over_another_key_does_not_decrypt(backend: Backend, size: int) -> None:
    secret = os.urandom(size)
    await put(backend.store, "files/file-a", secret)
    await put(backend.store, "files/file-b", os.urandom(50))
    await copy_raw(backend.raw, "files/file-a", "files/file-b")
    store = backend.reopen()
    with pytest.raises(ContentUnreadable):
        await store.read("files/file-b")
    with pytest.raises(ContentUnreadable):
        await store.size("files/file-b")
    assert await store.read("files/file-a") == secret


async def test_a_header_moved_onto_another_blob_does_not_decrypt(backend: Backend) -> None:
    await put(backend.store, "files/file-a", os.urandom(300))
    await put(backend.store, "files/file-b", os.urandom(300))
    a = await backend.raw.read("files/file-a", 0, HEADER + 300 + TAG)
    b = await backend.raw.read("files/file-b", 0, HEADER + 300 + TAG)
    writer = await backend.raw.writer("files/file-b")
    await writer.write(a[:HEADER] + b[HEADER:])
    await writer.commit()
    with pytest.raises(ContentUnreadable):
        await backend.reopen().read("files/file-b")


@pytest.mark.parametrize("size", [0, 5, SEGMENT, 2 * SEGMENT + 3])
async def test_legacy_blobs_are_read_only_when_allowed(backend: Backend, size: int) -> None:
    master = os.urandom(32)
    data = os.urandom(size)
    await put_legacy(backend.raw, master, KEY, data)
    with pytest.raises(ContentUnreadable):
        await EncryptedBlobStore(backend.raw, Keyring(master)).read(KEY)
    legacy = EncryptedBlobStore(backend.raw, Keyring(master), legacy_reads=True)
    assert await legacy.read(KEY) == data


async def test_reencrypt_binds_a_legacy_blob(backend: Backend) -> None:
    master = os.urandom(32)
    data = os.urandom(2 * SEGMENT + 3)
    await put_legacy(backend.raw, master, KEY, data)
    store = EncryptedBlobStore(backend.raw, Keyring(master), legacy_reads=True)
    assert await store.read(KEY, 0, 10) == data[:10]  # caches the old format's key
    assert await store.reencrypt(KEY) is True
    assert await store.reencrypt(KEY) is False
    assert await store.reencrypt("files/never-written") is False
    assert await store.read(KEY) == data
    assert (await backend.raw.read(KEY, 0, 4)) == b"BFE2"
    strict = EncryptedBlobStore(backend.raw, Keyring(master))
    assert await strict.read(KEY) == data
    await copy_raw(backend.raw, KEY, "files/other")
    with pytest.raises(ContentUnreadable):
        await strict.read("files/other")


# ---- encryption at rest (local backend) -------------------------------------------------


def stored_file(local: Backend) -> Path:
    assert local.root is not None
    return local.root / KEY


async def test_bytes_on_disk_are_not_the_plaintext(local: Backend) -> None:
    line = b'{"custom_id":"secret-request","body":{"messages":"my private prompt"}}\n'
    data = line * (SEGMENT // len(line) + 50)
    await put(local.store, KEY, data)
    raw = stored_file(local).read_bytes()
    assert b"secret-request" not in raw
    assert b"private prompt" not in raw
    assert line[:16] not in raw
    # Header, then each segment with its tag; nothing else.
    segments = -(-len(data) // SEGMENT)
    assert len(raw) == HEADER + len(data) + segments * TAG


async def test_same_plaintext_encrypts_differently(local: Backend) -> None:
    data = os.urandom(1000)
    await put(local.store, "files/one", data)
    await put(local.store, "files/two", data)
    assert local.root is not None
    one = (local.root / "files/one").read_bytes()
    two = (local.root / "files/two").read_bytes()
    assert one != two
    assert one[HEADER:] != two[HEADER:]


@pytest.mark.parametrize(
    "where",
    ["header", "first segment", "segment boundary", "last segment", "last tag byte"],
)
async def test_a_flipped_byte_makes_reads_fail(local: Backend, where: str) -> None:
    size = 2 * SEGMENT + 100
    await put(local.store, KEY, os.urandom(size))
    path = stored_file(local)
    raw = bytearray(path.read_bytes())
    position = {
        "header": 20,
        "first segment": HEADER + 5,
        "segment boundary": HEADER + SEGMENT + TAG,
        "last segment": HEADER + 2 * (SEGMENT + TAG) + 50,
        "last tag byte": len(raw) - 1,
    }[where]
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))
    store = local.reopen()
    with pytest.raises(DAMAGED):
        await store.read(KEY)


async def test_a_flipped_byte_fails_a_range_read_of_that_segment(local: Backend) -> None:
    data = os.urandom(2 * SEGMENT + 100)
    await put(local.store, KEY, data)
    path = stored_file(local)
    raw = bytearray(path.read_bytes())
    raw[HEADER + SEGMENT + TAG + 10] ^= 0x80  # inside segment 1
    path.write_bytes(bytes(raw))
    store = local.reopen()
    # Untouched segments still decrypt; the damaged one never yields plaintext.
    assert await store.read(KEY, 0, SEGMENT) == data[:SEGMENT]
    with pytest.raises(DAMAGED):
        await store.read(KEY, SEGMENT, SEGMENT + 1)


@pytest.mark.parametrize(
    "cut",
    [
        "inside the header",
        "right after the header",
        "a few bytes after the header",
        "at a segment boundary",
        "less than a tag into the last segment",
        "inside the last segment",
        "one byte",
    ],
)
async def test_a_truncated_file_makes_reads_fail(local: Backend, cut: str) -> None:
    size = 2 * SEGMENT + 100
    await put(local.store, KEY, os.urandom(size))
    path = stored_file(local)
    raw = path.read_bytes()
    keep = {
        "inside the header": HEADER // 2,
        "right after the header": HEADER,
        "a few bytes after the header": HEADER + 5,
        "at a segment boundary": HEADER + 2 * (SEGMENT + TAG),
        "less than a tag into the last segment": HEADER + 2 * (SEGMENT + TAG) + 5,
        "inside the last segment": HEADER + 2 * (SEGMENT + TAG) + 40,
        "one byte": len(raw) - 1,
    }[cut]
    path.write_bytes(raw[:keep])
    store = local.reopen()
    with pytest.raises(DAMAGED):
        await store.read(KEY)


async def test_segments_cannot_be_reordered(local: Backend) -> None:
    await put(local.store, KEY, os.urandom(3 * SEGMENT + 7))
    path = stored_file(local)
    raw = path.read_bytes()
    span = SEGMENT + TAG
    seg0, seg1 = raw[HEADER : HEADER + span], raw[HEADER + span : HEADER + 2 * span]
    path.write_bytes(raw[:HEADER] + seg1 + seg0 + raw[HEADER + 2 * span :])
    with pytest.raises(DAMAGED):
        await local.reopen().read(KEY, 0, 10)


async def test_a_different_master_key_cannot_read(local: Backend) -> None:
    await put(local.store, KEY, os.urandom(SEGMENT + 1))
    assert local.root is not None
    stranger = EncryptedBlobStore(LocalRawStore(local.root), Keyring(os.urandom(32)))
    with pytest.raises(DAMAGED):
        await stranger.read(KEY)


async def test_key_file_is_reused(tmp_path: Path) -> None:
    key_file = tmp_path / "master.key"
    key_file.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    first = load_master_key(None, key_file)
    assert first.new is None
    root = tmp_path / "blobs"
    data = os.urandom(SEGMENT + 11)
    await put(EncryptedBlobStore(LocalRawStore(root), first.keyring), KEY, data)
    second = load_master_key(None, key_file).keyring
    assert await EncryptedBlobStore(LocalRawStore(root), second).read(KEY) == data


async def test_configured_master_key_wins_over_the_key_file(tmp_path: Path) -> None:
    master = os.urandom(32)
    key_file = tmp_path / "master.key"
    loaded = load_master_key(base64.b64encode(master).decode(), key_file)
    assert loaded.new is None
    assert not key_file.exists()
    root = tmp_path / "blobs"
    data = os.urandom(1234)
    await put(EncryptedBlobStore(LocalRawStore(root), loaded.keyring), KEY, data)
    assert await EncryptedBlobStore(LocalRawStore(root), Keyring(master)).read(KEY) == data


def test_master_key_must_be_32_bytes() -> None:
    with pytest.raises(ValueError):
        Keyring(os.urandom(16))


def test_sealed_records_need_the_same_context() -> None:
    keyring = Keyring(os.urandom(32))
    sealed = keyring.seal(b"result payload", b"batch_1/7")
    assert b"result payload" not in sealed
    assert keyring.open(sealed, b"batch_1/7") == b"result payload"
    with pytest.raises(InvalidTag):
        keyring.open(sealed, b"batch_1/8")
    with pytest.raises(InvalidTag):
        Keyring(os.urandom(32)).open(sealed, b"batch_1/7")


async def test_a_second_process_opening_the_store_keeps_a_write_in_progress(
    tmp_path: Path,
) -> None:
    # An API and its workers share one blob directory; a worker starting mid-upload must not
    # take the API's partial file away.
    root = tmp_path / "blobs"
    writer = await LocalRawStore(root).writer(KEY)
    await writer.write(b"first half ")
    LocalRawStore(root)
    await writer.write(b"second half")
    await writer.commit()
    assert await LocalRawStore(root).read(KEY, 0, 22) == b"first half second half"


def test_partial_writes_of_a_process_long_gone_are_removed_at_start(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    LocalRawStore(root)
    old, fresh = root / ".tmp" / "old", root / ".tmp" / "fresh"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    day_ago = time.time() - 86_400
    os.utime(old, (day_ago, day_ago))
    LocalRawStore(root)
    assert sorted(p.name for p in (root / ".tmp").iterdir()) == ["fresh"]
