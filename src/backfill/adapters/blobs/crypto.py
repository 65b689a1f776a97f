"""AES-256-GCM envelope encryption in fixed-size segments (a STREAM construction).

Layout of an encrypted blob::

    magic "BFE1" | segment size (u32) | nonce prefix (7 bytes) | wrapped data key (60 bytes)
    segment 0 ciphertext + tag | segment 1 ciphertext + tag | ...

Each segment's nonce is ``prefix || index (u32) || last (u8)``, so segments cannot be reordered
and a truncated blob fails to decrypt. A plaintext range decrypts only the segments it touches.
"""

from __future__ import annotations

import base64
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"BFE1"
SEGMENT = 1024 * 1024
TAG = 16
_WRAPPED = 12 + 32 + TAG
HEADER = len(MAGIC) + 4 + 7 + _WRAPPED
_WRAP_AAD = b"backfill-data-key"


@dataclass(frozen=True, slots=True)
class BlobKey:
    """What decrypting one blob needs, parsed from its header."""

    cipher: AESGCM
    prefix: bytes
    segment: int


class Keyring:
    """Holds the master key; wraps per-blob data keys and seals small records."""

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) != 32:
            raise ValueError("the master key must be 32 bytes (base64 of 32 random bytes)")
        self._master = AESGCM(master_key)
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"backfill-records"
        ).derive(master_key)
        self._records = AESGCM(derived)

    @classmethod
    def from_settings(cls, master_key: str | None, key_file: Path) -> Keyring:
        """Use the configured key, else the key file, creating it (mode 0600) on first start."""
        if master_key:
            return cls(base64.b64decode(master_key))
        if not key_file.exists():
            key_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(base64.b64encode(AESGCM.generate_key(bit_length=256)) + b"\n")
        return cls(base64.b64decode(key_file.read_bytes().strip()))

    def new_header(self, segment: int = SEGMENT) -> tuple[bytes, BlobKey]:
        data_key = AESGCM.generate_key(bit_length=256)
        nonce = os.urandom(12)
        wrapped = nonce + self._master.encrypt(nonce, data_key, _WRAP_AAD)
        prefix = os.urandom(7)
        header = MAGIC + struct.pack(">I", segment) + prefix + wrapped
        return header, BlobKey(AESGCM(data_key), prefix, segment)

    def parse_header(self, header: bytes) -> BlobKey:
        if len(header) < HEADER or header[:4] != MAGIC:
            raise ValueError("not an encrypted Backfill blob")
        (segment,) = struct.unpack(">I", header[4:8])
        prefix = header[8:15]
        wrapped = header[15:HEADER]
        data_key = self._master.decrypt(wrapped[:12], wrapped[12:], _WRAP_AAD)
        return BlobKey(AESGCM(data_key), prefix, segment)

    def seal(self, data: bytes, context: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._records.encrypt(nonce, data, context)

    def open(self, data: bytes, context: bytes) -> bytes:
        return self._records.decrypt(data[:12], data[12:], context)


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
