"""Engines managed at run time, on SQLite and PostgreSQL (docs/fleet.md): validated as the
config file's ``[[engines]]`` would be, stored with the API key sealed, changed and removed;
and the config file seeds the table (the file wins for the names it lists, and its engines
it no longer lists are removed)."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
from cryptography.exceptions import InvalidTag

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.engine_config import EngineSource
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode
from backfill.errors import Conflict, InvalidInput, NotFound
from backfill.runner.discovery import Replica
from backfill.runner.engine_pool import EnginePool
from backfill.runner.stored_engines import StoredEngines
from backfill.services.engine_admin import EngineAdmin
from backfill.settings import EngineSettings
from tests.unit.test_runner_engines import Recorder

VLLM = {"name": "vllm-a", "base_url": "http://10.0.0.5:8000/v1", "models": ["qwen"]}


def admin_of(store: SqlStore, keyring: Keyring | None = None) -> EngineAdmin:
    return EngineAdmin(
        store, keyring or Keyring(os.urandom(32)), ManualClock(1_000.0), reserved=["local"]
    )


async def test_an_engine_is_stored_as_validated_with_its_key_sealed(store: SqlStore) -> None:
    admin = admin_of(store)
    added = await admin.add(VLLM | {"max_concurrency": 32, "api_key": "engine-secret"})
    assert added.source == EngineSource.API
    assert added.enabled
    assert added.spec == {"base_url": VLLM["base_url"], "models": ["qwen"], "max_concurrency": 32}
    assert added.api_key_sealed is not None
    assert b"engine-secret" not in added.api_key_sealed
    stored = await admin.get("vllm-a")
    assert admin.api_key(stored) == "engine-secret"
    assert admin.settings(stored).max_concurrency == 32
    assert [e.name for e in await admin.all()] == ["vllm-a"]


async def test_bad_engines_are_refused_naming_the_field(store: SqlStore) -> None:
    admin = admin_of(store)
    refusals: dict[str, dict[str, Any]] = {
        "max_concurrency": VLLM | {"max_concurrency": 0},
        "Unknown engine setting 'maxconcurrency'": VLLM | {"maxconcurrency": 4},
        "'command' starts an engine": VLLM | {"command": ["vllm", "serve"]},
        "'name' is required": {"base_url": "http://x/v1", "models": ["m"]},
        "models": {"name": "x", "base_url": "http://x/v1"},
        "'enabled' must be true or false": VLLM | {"enabled": "yes"},
        "discovery needs base_url": VLLM | {"discovery": "dns", "base_url": ""},
    }
    for message, fields in refusals.items():
        with pytest.raises(InvalidInput, match=message):
            await admin.add(fields)
    with pytest.raises(Conflict, match="runs from this process's config file"):
        await admin.add(VLLM | {"name": "local"})
    await admin.add(VLLM)
    with pytest.raises(Conflict, match="stored already"):
        await admin.add(VLLM)
    assert [e.name for e in await admin.all()] == ["vllm-a"]


async def test_a_change_keeps_what_it_does_not_name_and_a_removal_is_final(
    store: SqlStore,
) -> None:
    admin = admin_of(store)
    await admin.add(VLLM | {"api_key": "engine-secret", "mode": "shared"})
    changed = await admin.change("vllm-a", {"max_concurrency": 8, "priority": 10})
    assert admin.settings(changed).mode == "shared"
    assert admin.api_key(changed) == "engine-secret", "a change that names no key keeps it"
    assert changed.spec["priority"] == 10
    disabled = await admin.change("vllm-a", {"enabled": False, "api_key": None})
    assert not disabled.enabled
    assert disabled.api_key_sealed is None
    with pytest.raises(InvalidInput, match="max_concurrency"):
        await admin.change("vllm-a", {"max_concurrency": -1})
    with pytest.raises(InvalidInput, match="name cannot change"):
        await admin.change("vllm-a", {"name": "vllm-b"})
    await admin.remove("vllm-a")
    with pytest.raises(NotFound):
        await admin.get("vllm-a")
    with pytest.raises(NotFound):
        await admin.remove("vllm-a")
    with pytest.raises(NotFound):
        await admin.change("vllm-a", {"max_concurrency": 8})


async def test_the_config_file_seeds_the_table_and_wins_for_its_names(store: SqlStore) -> None:
    keyring = Keyring(os.urandom(32))
    admin = admin_of(store, keyring)
    in_file = EngineSettings.model_validate(VLLM | {"api_key": "k"})
    managed = EngineSettings.model_validate(VLLM | {"name": "managed", "command": ["x"]})
    await admin.add({"name": "from-api", "base_url": "http://10.0.0.9:8000/v1", "models": ["m"]})
    await admin.seed([in_file, managed])
    seeded = await admin.get("vllm-a")
    assert seeded.source == EngineSource.FILE
    assert admin.api_key(seeded) == "k"
    assert {e.name for e in await admin.all()} == {"vllm-a", "from-api"}, "command engines stay"
    # Another worker starting with the same file rewrites nothing (its key is not sealed again).
    await admin_of(store, keyring).seed([in_file])
    assert (await admin.get("vllm-a")).api_key_sealed == seeded.api_key_sealed
    # A change through the API holds until a file listing the engine is read again.
    await admin.change("vllm-a", {"max_concurrency": 4})
    await admin.seed([in_file])
    assert admin.settings(await admin.get("vllm-a")).max_concurrency == 16
    # A file without engines (a worker that follows the API alone) removes nothing.
    await admin.seed([])
    assert {e.name for e in await admin.all()} == {"vllm-a", "from-api"}
    # An engine the file no longer lists goes; those added through the API stay.
    other = EngineSettings.model_validate(VLLM | {"name": "vllm-b"})
    await admin.seed([other])
    assert {e.name for e in await admin.all()} == {"vllm-b", "from-api"}


async def test_a_stored_engine_named_like_a_workers_own_is_not_served_there(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's own engine of that name (one with a command) goes on; the stored one is
    skipped with one warning, and the other stored engines are still served."""
    admin = admin_of(store)
    await admin.add({"name": "chat", "base_url": "http://10.0.0.9:8000/v1", "models": ["m"]})
    await admin.add({"name": "other", "base_url": "http://10.0.0.8:8000/v1", "models": ["m"]})
    own = FakeEngine("chat", ("m",))
    pool = EnginePool([own], Recorder().start, clock=SystemClock())

    def build(spec: EngineSettings) -> Replica:
        return Replica(FakeEngine(spec.name, ("m",)), ConcurrencyLimit(4, Mode.DEDICATED))

    stored = StoredEngines(pool, admin, build, SystemClock(), poll_s=1.0)
    with caplog.at_level(logging.WARNING, logger="backfill.runner"):
        await stored.start()
        await stored.step()
    assert [s.engine for s in pool.slots if s.engine.name == "chat"] == [own]
    assert {s.engine.name for s in pool.slots} == {"chat", "other"}
    warned = [r.getMessage() for r in caplog.records if "an engine of its own" in r.getMessage()]
    assert len(warned) == 1, warned


async def test_settings_are_shown_without_opening_the_key(store: SqlStore) -> None:
    """A key sealed under another master key (a restore from elsewhere) keeps the engine
    from being served, not its settings from being listed."""
    await admin_of(store, Keyring(os.urandom(32))).add(VLLM | {"api_key": "k"})
    other = admin_of(store, Keyring(os.urandom(32)))
    stored = await other.get("vllm-a")
    assert other.shown(stored).base_url == VLLM["base_url"]
    assert other.shown(stored).api_key is None
    with pytest.raises(InvalidTag):
        other.settings(stored)
