"""The master key is checked against the database at every start, never silently replaced."""

from __future__ import annotations

import base64
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from backfill.adapters.blobs.master import MasterKeyError, load_master_key
from backfill.container import build
from backfill.simulator.server import Simulator
from tests.support import chat_line, in_process_backfill, jsonl, sim_settings

Sim = tuple[str, Simulator]


async def stored_data(tmp_path: Path, sim: Sim) -> Path:
    """A data directory whose database holds an org and a file; returns it (stopped)."""
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        assert (await bf.upload(jsonl([chat_line("a")]))).status_code == 200
        return bf.settings.data_dir


async def restart(tmp_path: Path, sim: Sim) -> None:
    """Start and stop Backfill on the data directory of ``stored_data``."""
    backfill = build(sim_settings(tmp_path / "data", sim[0]), engines=[])
    try:
        await backfill.start()
    finally:
        await backfill.stop()


def new_key_text() -> bytes:
    return base64.b64encode(os.urandom(32)) + b"\n"


async def test_first_start_saves_a_private_key_and_its_check_value(
    tmp_path: Path, sim: Sim
) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        key_file = bf.settings.data_dir / "master.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        record = await bf.backfill.store.keyring()
        assert record is not None
        assert bf.backfill.master.keyring.matches(record.check_value)
        assert record.min_blob_format == 2
        assert key_file.read_bytes().strip().decode() not in record.check_value


async def test_a_missing_key_file_over_stored_data_refuses_to_start(
    tmp_path: Path, sim: Sim
) -> None:
    data = await stored_data(tmp_path, sim)
    (data / "master.key").unlink()
    with pytest.raises(MasterKeyError, match=r"master\.key is missing.*Restore"):
        await restart(tmp_path, sim)
    assert not (data / "master.key").exists(), "a new key was written over existing data"


async def test_another_key_refuses_to_start(tmp_path: Path, sim: Sim) -> None:
    data = await stored_data(tmp_path, sim)
    (data / "master.key").write_bytes(new_key_text())
    with pytest.raises(MasterKeyError, match="not the key this database"):
        await restart(tmp_path, sim)


async def test_another_configured_key_refuses_to_start(tmp_path: Path, sim: Sim) -> None:
    await stored_data(tmp_path, sim)
    settings = sim_settings(
        tmp_path / "data", sim[0], master_key=base64.b64encode(os.urandom(32)).decode()
    )
    backfill = build(settings, engines=[])
    with pytest.raises(MasterKeyError, match="BACKFILL_MASTER_KEY"):
        await backfill.start()
    await backfill.stop()


async def test_the_right_key_starts_again(tmp_path: Path, sim: Sim) -> None:
    data = await stored_data(tmp_path, sim)
    saved = (data / "master.key").read_bytes()
    (data / "master.key").unlink()
    with pytest.raises(MasterKeyError):
        await restart(tmp_path, sim)
    (data / "master.key").write_bytes(saved)
    await restart(tmp_path, sim)


async def test_a_database_from_before_the_check_records_the_key_in_use(
    tmp_path: Path, sim: Sim
) -> None:
    data = await stored_data(tmp_path, sim)
    with sqlite3.connect(data / "backfill.db") as db:
        db.execute("DELETE FROM keyring")
    key = (data / "master.key").read_bytes()
    (data / "master.key").unlink()
    with pytest.raises(MasterKeyError, match="missing"):
        await restart(tmp_path, sim)
    (data / "master.key").write_bytes(key)
    await restart(tmp_path, sim)
    with sqlite3.connect(data / "backfill.db") as db:
        rows = db.execute("SELECT min_blob_format FROM keyring").fetchall()
    # Its files may predate the binding of blobs to their key: the old format stays readable.
    assert rows == [(1,)]


async def test_a_database_from_before_the_check_refuses_a_key_that_opens_nothing(
    tmp_path: Path, sim: Sim
) -> None:
    data = await stored_data(tmp_path, sim)
    with sqlite3.connect(data / "backfill.db") as db:
        db.execute("DELETE FROM keyring")
    (data / "master.key").write_bytes(new_key_text())
    with pytest.raises(MasterKeyError, match="cannot open the content"):
        await restart(tmp_path, sim)
    with sqlite3.connect(data / "backfill.db") as db:
        assert db.execute("SELECT count(*) FROM keyring").fetchall() == [(0,)]


@pytest.mark.parametrize(
    "content",
    [b"%%% not base64 %%%\n", base64.b64encode(os.urandom(16)) + b"\n", b"", b"\n"],
    ids=["garbage", "16 bytes", "empty", "blank line"],
)
def test_an_unusable_key_file_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    key_file = tmp_path / "master.key"
    key_file.write_bytes(content)
    with pytest.raises(MasterKeyError, match=r"master\.key is not base64 of 32 bytes") as raised:
        load_master_key(None, key_file)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("value", ["%%%", base64.b64encode(os.urandom(31)).decode(), " "])
def test_an_unusable_configured_key_is_a_clear_error(tmp_path: Path, value: str) -> None:
    with pytest.raises(MasterKeyError, match="BACKFILL_MASTER_KEY"):
        load_master_key(value, tmp_path / "master.key")
