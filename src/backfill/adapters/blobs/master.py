"""The master key: where it comes from, and the check that it is the key the database's
content was sealed with.

A missing key file must never turn into a silent new key over existing data: everything
already stored would become unreadable, and batches would fail one by one. So a new key is
only made for a database that holds nothing, and every start compares the key's check value
with the one stored in the database.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from backfill.adapters.blobs.crypto import (
    Keyring,
    MasterKeyInvalid,
    decode_master_key,
    new_master_key,
)
from backfill.adapters.private import create_private, fsync_dir, private_dir
from backfill.domain.records import KeyringRecord
from backfill.ports import KeyringStore

SETTING = "master_key (BACKFILL_MASTER_KEY)"
# Format 2 binds each blob to its storage key; a database that starts empty never needs 1.
CURRENT_BLOB_FORMAT = 2


class MasterKeyError(Exception):
    """The master key cannot be used with this database; the message says what to do."""


@dataclass(frozen=True, slots=True)
class MasterKey:
    keyring: Keyring
    source: str
    """The setting or file the key came from, for messages."""
    key_file: Path
    new: bytes | None = None
    """A key made now because the key file is missing; saved only for an empty database."""


def load_master_key(setting: str | None, key_file: Path) -> MasterKey:
    """The configured key, else the key file's, else a new one (not saved yet).

    Raises ``MasterKeyError`` for a key that is not base64 of 32 bytes or an unreadable file.
    """
    try:
        if setting:
            return MasterKey(Keyring(decode_master_key(setting, SETTING)), SETTING, key_file)
        try:
            text = key_file.read_bytes()
        except FileNotFoundError:
            key = new_master_key()
            return MasterKey(Keyring(key), str(key_file), key_file, new=key)
        except OSError as exc:
            raise MasterKeyError(
                f"Cannot read the master key file {key_file}: {exc.strerror}."
            ) from None
        return MasterKey(Keyring(decode_master_key(text, str(key_file))), str(key_file), key_file)
    except MasterKeyInvalid as exc:
        raise MasterKeyError(str(exc)) from None


async def verify_master_key(
    records: KeyringStore,
    master: MasterKey,
    now: int,
    opens_stored_content: Callable[[], Awaitable[bool | None]],
) -> int:
    """Check ``master`` against the database, recording it there on first use.

    ``opens_stored_content`` answers whether the key unwraps some stored blob (None when there
    is none to try). Returns the oldest blob format reads must still accept. Raises
    ``MasterKeyError`` when the key is not the database's, or when the key file is missing and
    the database holds data.
    """
    stored = await records.keyring()
    if stored is None:
        holds = await records.holds_content()
        if master.new is not None and holds:
            raise MasterKeyError(_missing(master))
        if master.new is not None:
            _save(master.key_file, master.new)
        # A database from before the check: the key in use now is recorded, but only once it
        # is shown to open what is stored: a wrong key recorded here would fail every batch.
        if holds and await opens_stored_content() is False:
            raise MasterKeyError(
                f"The master key from {master.source} cannot open the content this database "
                "holds. Restore the key it was written with (from a backup of master.key or of "
                "BACKFILL_MASTER_KEY)."
            )
        # Its blobs may still be format 1 (not bound to their names).
        floor = 1 if holds else CURRENT_BLOB_FORMAT
        stored = await records.init_keyring(KeyringRecord(master.keyring.check_value(), floor, now))
    if not master.keyring.matches(stored.check_value):
        if master.new is not None:
            raise MasterKeyError(_missing(master))
        raise MasterKeyError(
            f"The master key from {master.source} is not the key this database's content was "
            "written with. Restore the original key (from a backup of master.key or of "
            "BACKFILL_MASTER_KEY); a different key cannot read anything stored."
        )
    return stored.min_blob_format


def _missing(master: MasterKey) -> str:
    return (
        f"The master key file {master.key_file} is missing, but the database already holds "
        "encrypted content. Restore master.key from a backup (or set BACKFILL_MASTER_KEY to "
        "its value); Backfill does not make a new key over existing data."
    )


def _save(key_file: Path, key: bytes) -> None:
    if not key_file.parent.is_dir():
        private_dir(key_file.parent)
    try:
        fd = create_private(key_file)
    except FileExistsError:
        raise MasterKeyError(
            f"The master key file {key_file} appeared while Backfill was starting; start again."
        ) from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(base64.b64encode(key) + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    with contextlib.suppress(OSError):
        fsync_dir(key_file.parent)
