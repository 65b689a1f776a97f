"""AES-256-GCM envelope encryption in fixed-size segments (a STREAM construction).

Layout of an encrypted blob::

    magic "BFE2" | segment size (u32) | nonce prefix (7 bytes) | wrapped data key (60 bytes)
    segment 0 ciphertext + tag | segment 1 ciphertext + tag | ...

Each segment's nonce is ``prefix || index (u32) || last (u8)``, so segments cannot be reordered
and a truncated blob fails to decrypt. A plaintext range decrypts only the segments it touches.

Format 2 binds a blob to its storage key: the wrapped data key is sealed with the header and the
key as associated data, and every segment with the key, so a blob copied over another one (say,
another tenant's file) fails to decrypt instead of being served under the wrong name. Format 1
("BFE1") had no binding; it stays readable only while a database still has such blobs.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from backfill.domain.chunks import INPUT_SEGMENT_BYTES

MAGIC = b"BFE2"
LEGACY_MAGIC = b"BFE1"
SEGMENT = INPUT_SEGMENT_BYTES  # chunks of work are cut to these segments
TAG = 16
_WRAPPED = 12 + 32 + TAG
HEADER = len(MAGIC) + 4 + 7 + _WRAPPED
_LEGACY_WRAP_AAD = b"backfill-data-key"
_CHECK_MESSAGE = b"backfill master key check"


class MasterKeyInvalid(ValueError):
    """The configured master key is not base64 of 32 bytes; the message says what to do."""


@dataclass(frozen=True, slots=True)
class BlobKey:
    """What decrypting one blob needs, parsed from its header."""

    cipher: AESGCM
    prefix: bytes
    segment: int
    aad: bytes | None
    """Associated data of every segment: the storage key (format 2), None for format 1."""
    version: int


def decode_master_key(text: str | bytes, where: str) -> bytes:
    """The 32 raw bytes of a base64 master key; ``where`` names its source in the error."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise MasterKeyInvalid(
            f"The master key in {where} is not base64 of 32 bytes; restore the key this "
            "database was written with (a new one can be made with: openssl rand -base64 32)."
        )
    return key


def new_master_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


class Keyring:
    """Holds the master key; wraps per-blob data keys and seals small records."""

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) != 32:
            raise MasterKeyInvalid("the master key must be 32 bytes (base64 of 32 random bytes)")
        self._master = AESGCM(master_key)
        self._records = AESGCM(_derive(master_key, b"backfill-records"))
        self._check = _derive(master_key, b"backfill-key-check")

    def check_value(self) -> str:
        """A value that identifies the master key without revealing it (stored in the database)."""
        return hmac.new(self._check, _CHECK_MESSAGE, "sha256").hexdigest()

    def matches(self, check_value: str) -> bool:
        return hmac.compare_digest(self.check_value(), check_value)

    def new_header(self, key: str, segment: int = SEGMENT) -> tuple[bytes, BlobKey]:
        """A format-2 header for the blob stored under ``key`` and the key to encrypt it."""
        data_key = AESGCM.generate_key(bit_length=256)
        prefix = os.urandom(7)
        start = MAGIC + struct.pack(">I", segment) + prefix
        nonce = os.urandom(12)
        wrapped = nonce + self._master.encrypt(nonce, data_key, _wrap_aad(start, key))
        return start + wrapped, BlobKey(AESGCM(data_key), prefix, segment, key.encode(), 2)

    def parse_header(self, header: bytes, key: str, *, legacy: bool) -> BlobKey:
        """The blob key from a header; raises ValueError or InvalidTag when it cannot be used.

        ``legacy`` allows format 1, which is not bound to its storage key.
        """
        if len(header) < HEADER:
            raise ValueError("truncated header")
        magic, start, wrapped = header[:4], header[:15], header[15:HEADER]
        (segment,) = struct.unpack(">I", header[4:8])
        if segment == 0:
            raise ValueError("segment size 0")
        if magic == MAGIC:
            aad, version = _wrap_aad(start, key), 2
        elif magic == LEGACY_MAGIC and legacy:
            aad, version = _LEGACY_WRAP_AAD, 1
        elif magic == LEGACY_MAGIC:
            raise ValueError("format 1 is no longer accepted")
        else:
            raise ValueError("not an encrypted Backfill blob")
        data_key = self._master.decrypt(wrapped[:12], wrapped[12:], aad)
        segment_aad = key.encode() if version == 2 else None
        return BlobKey(AESGCM(data_key), header[8:15], segment, segment_aad, version)

    def seal(self, data: bytes, context: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._records.encrypt(nonce, data, context)

    def open(self, data: bytes, context: bytes) -> bytes:
        return self._records.decrypt(data[:12], data[12:], context)


def _derive(master_key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(master_key)


def _wrap_aad(header_start: bytes, key: str) -> bytes:
    # The header fields before the wrapped key, then the storage key: a header moved to another
    # blob, or edited in place, no longer unwraps.
    return header_start + b"\x00" + key.encode()


def header_version(header: bytes) -> int | None:
    """1 or 2 for a Backfill blob header, None for anything else."""
    return {LEGACY_MAGIC: 1, MAGIC: 2}.get(header[:4])


def segment_nonce(key: BlobKey, index: int, last: bool) -> bytes:
    return key.prefix + struct.pack(">IB", index, 1 if last else 0)


def plaintext_size(raw_size: int, segment: int) -> tuple[int, int]:
    """(plaintext bytes, segment count) of an encrypted blob of ``raw_size`` bytes.

    Raises ValueError for a size no complete blob can have (it was truncated).
    """
    body = raw_size - HEADER
    full, rest = divmod(body, segment + TAG)
    if rest == 0 and full > 0:
        count = full
    elif rest >= TAG:
        count = full + 1
    else:
        raise ValueError("truncated encrypted blob")
    return body - count * TAG, count
