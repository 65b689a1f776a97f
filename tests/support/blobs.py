"""Blobs as older releases wrote them."""

from __future__ import annotations

import os


def legacy_blob(master: bytes, data: bytes) -> bytes:
    """``data`` encrypted in blob format 1 ("BFE1", not bound to its key), as releases before
    the binding wrote it."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from backfill.adapters.blobs.crypto import SEGMENT

    data_key, prefix, nonce = AESGCM.generate_key(bit_length=256), os.urandom(7), os.urandom(12)
    wrapped = nonce + AESGCM(master).encrypt(nonce, data_key, b"backfill-data-key")
    out = [b"BFE1" + SEGMENT.to_bytes(4, "big") + prefix + wrapped]
    chunks = [data[i : i + SEGMENT] for i in range(0, len(data), SEGMENT)] or [b""]
    for index, chunk in enumerate(chunks):
        last = 1 if index == len(chunks) - 1 else 0
        seal = prefix + index.to_bytes(4, "big") + bytes([last])
        out.append(AESGCM(data_key).encrypt(seal, chunk, None))
    return b"".join(out)
