"""Engines managed at run time (docs/fleet.md): added, changed and removed through the admin
API and CLI, stored for every worker to serve within seconds, no restart.

Each engine is validated as the config file's ``[[engines]]`` table would be (the same
settings, the same messages), stored without its API key, and its key sealed under the master
key: no API, list or log ever shows it.

The config files seed the table: each worker, as it starts, writes the engines its file lists
(the file wins for the names it lists) and removes the file's engines it no longer lists.
Engines added through the API are left alone unless a file lists their name.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from backfill.domain.engine_config import EngineSource, StoredEngine
from backfill.errors import Conflict, InvalidInput, NotFound
from backfill.ports import Clock, EngineConfigStore, Sealer
from backfill.settings import EngineSettings

log = logging.getLogger("backfill.engines")

# Settings an engine in the table may not have: a managed engine runs in the process whose
# file lists it, at one address, so it stays there.
_FILE_ONLY = frozenset({"command"})
# What a change may set besides the engine's settings.
_SWITCHES = frozenset({"enabled"})


def _context(name: str) -> bytes:
    return b"engine-api-key:" + name.encode()


class EngineAdmin:
    def __init__(
        self,
        store: EngineConfigStore,
        sealer: Sealer,
        clock: Clock,
        *,
        reserved: Collection[str] = (),
    ) -> None:
        """``reserved``: names of engines that only this process's file may run (the bundled
        ones, and those with a ``command``)."""
        self._store = store
        self._sealer = sealer
        self._clock = clock
        self._reserved = frozenset(reserved)

    async def all(self) -> list[StoredEngine]:
        return await self._store.stored_engines()

    async def get(self, name: str) -> StoredEngine:
        found = await self._store.stored_engine(name)
        if found is None:
            raise NotFound(f"No engine named {name!r} is stored.", param="name")
        return found

    async def add(self, fields: Mapping[str, Any]) -> StoredEngine:
        """A new engine from the fields of an ``[[engines]]`` table (``enabled`` too)."""
        name = fields.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(
                "'name' is required: the engine's name, e.g. \"vllm-a\".", param="name"
            )
        if name in self._reserved:
            raise Conflict(
                f"An engine named {name!r} runs from this process's config file; choose another "
                "name.",
                param="name",
            )
        settings = _validated({k: v for k, v in fields.items() if k not in _SWITCHES})
        enabled = _enabled(fields.get("enabled", True))
        engine = self._stored(settings, enabled, EngineSource.API)
        if not await self._store.create_engine(engine):
            raise Conflict(
                f"An engine named {name!r} is stored already; change it with PATCH "
                f"/admin/v1/engines/{name} (backfill admin engine set).",
                param="name",
            )
        log.info("engine %s added: every worker serves it within seconds", name)
        return engine

    async def change(self, name: str, fields: Mapping[str, Any]) -> StoredEngine:
        """Set some of a stored engine's settings (``api_key`` null removes it; ``enabled``
        false drains it: no new work, what runs finishes). Applies at once on every worker:
        new requests follow the new settings, requests running finish under the old."""
        found = await self.get(name)
        if "name" in fields and fields["name"] != name:
            raise InvalidInput(
                "An engine's name cannot change; add one under the new name.", param="name"
            )
        merged: dict[str, Any] = {"name": name, **found.spec}
        if "api_key" not in fields and found.api_key_sealed is not None:
            merged["api_key"] = self.api_key(found)
        merged.update({k: v for k, v in fields.items() if k not in _SWITCHES})
        settings = _validated(merged)
        enabled = _enabled(fields.get("enabled", found.enabled))
        engine = self._stored(settings, enabled, found.source)
        await self._store.write_engine(engine)
        log.info("engine %s changed (%s)", name, ", ".join(sorted(fields)) or "nothing")
        return engine

    async def remove(self, name: str) -> None:
        """Remove the engine: every worker takes no new work to it, lets what runs there
        finish, then forgets it."""
        if not await self._store.delete_engine(name):
            raise NotFound(f"No engine named {name!r} is stored.", param="name")
        log.info("engine %s removed: workers drain it and let it go", name)

    async def seed(self, specs: Sequence[EngineSettings]) -> None:
        """Write the engines a config file lists (the file wins for their names) and remove
        the file's engines it no longer lists (when it lists any). One that is stored as the
        file says is left as it is: every worker that starts must not make the others rebuild
        it."""
        listed = {spec.name: spec for spec in specs if not spec.command}
        # A file without engines removes nothing: a worker configured to follow the API only
        # (or started from an old file mid-rollout) must not drain every worker's engines.
        for stored in await self._store.stored_engines() if listed else []:
            if stored.source == EngineSource.FILE and stored.name not in listed:
                await self._store.delete_engine(stored.name)
                log.info("engine %s is no longer in the config file: removed", stored.name)
        for name, spec in listed.items():
            found = await self._store.stored_engine(name)
            if found is not None and self._same(found, spec):
                continue
            if found is not None:
                log.info(
                    "engine %s: the config file's settings replace those stored (changed "
                    "through the admin API since); change the file to keep a change",
                    name,
                )
            await self._store.write_engine(self._stored(spec, True, EngineSource.FILE))

    def api_key(self, engine: StoredEngine) -> str | None:
        """The engine's API key, opened (for the worker that calls it; never shown)."""
        if engine.api_key_sealed is None:
            return None
        return self._sealer.open(engine.api_key_sealed, _context(engine.name)).decode()

    def settings(self, engine: StoredEngine) -> EngineSettings:
        """The stored engine as the settings a worker builds it from."""
        return EngineSettings.model_validate(
            {"name": engine.name, **engine.spec, "api_key": self.api_key(engine)}
        )

    def shown(self, engine: StoredEngine) -> EngineSettings:
        """The stored engine's settings without its API key, which is not even opened: a key
        sealed under another master key must not keep the others from being listed."""
        return EngineSettings.model_validate({"name": engine.name, **engine.spec})

    def _same(self, stored: StoredEngine, spec: EngineSettings) -> bool:
        return (
            stored.enabled
            and stored.source == EngineSource.FILE
            and dict(stored.spec) == _spec(spec)
            and self.api_key(stored) == spec.api_key
        )

    def _stored(self, spec: EngineSettings, enabled: bool, source: EngineSource) -> StoredEngine:
        sealed = None
        if spec.api_key is not None:
            sealed = self._sealer.seal(spec.api_key.encode(), _context(spec.name))
        return StoredEngine(spec.name, _spec(spec), sealed, enabled, source, self._clock.now())


def _spec(spec: EngineSettings) -> dict[str, Any]:
    """What is stored of an engine's settings: those not at their default, as JSON."""
    return spec.model_dump(mode="json", exclude={"name", "api_key"}, exclude_defaults=True)


def _validated(fields: Mapping[str, Any]) -> EngineSettings:
    known = set(EngineSettings.model_fields) - _FILE_ONLY
    unknown = sorted(set(fields) - known - _FILE_ONLY)
    if unknown:
        raise InvalidInput(
            f"Unknown engine setting {unknown[0]!r}; an engine takes "
            f"{', '.join(sorted(known | _SWITCHES))}.",
            param=unknown[0],
        )
    if any(fields.get(key) for key in _FILE_ONLY):
        raise InvalidInput(
            "'command' starts an engine in the process whose config file lists it; an engine "
            "managed here runs elsewhere: give its base_url.",
            param="command",
        )
    try:
        return EngineSettings.model_validate(dict(fields))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        raise InvalidInput(
            f"{where}: {message}" if where else message, param=where or None
        ) from None


def _enabled(value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput("'enabled' must be true or false.", param="enabled")
    return value
