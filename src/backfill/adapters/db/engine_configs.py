"""Engines every worker serves, managed at run time (docs/fleet.md): one row each."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select, true

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.engine_config import EngineSource, StoredEngine

_e = t.engines


def _values(engine: StoredEngine) -> dict[str, Any]:
    return {
        "name": engine.name,
        "spec": dict(engine.spec),
        "api_key_sealed": engine.api_key_sealed,
        "enabled": engine.enabled,
        "source": engine.source.value,
        "updated_at": engine.updated_at,
    }


def _engine(row: Any) -> StoredEngine:
    return StoredEngine(
        name=row.name,
        spec=dict(row.spec),
        api_key_sealed=row.api_key_sealed,
        enabled=bool(row.enabled),
        source=EngineSource(row.source),
        updated_at=row.updated_at,
    )


class EngineConfigQueries(SqlBase):
    async def stored_engines(self) -> list[StoredEngine]:
        async with self.engine.connect() as conn:
            return [_engine(r) for r in await conn.execute(select(_e).order_by(_e.c.name))]

    async def stored_engine(self, name: str) -> StoredEngine | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(_e).where(_e.c.name == name))).first()
        return _engine(row) if row is not None else None

    async def create_engine(self, engine: StoredEngine) -> bool:
        async with self.writing() as conn:
            done = await conn.execute(self.dialect.insert_ignoring(_e).values(**_values(engine)))
        return done.rowcount == 1

    async def write_engine(self, engine: StoredEngine) -> None:
        values = _values(engine)
        replace = [name for name in values if name != "name"]
        async with self.writing() as conn:
            await conn.execute(self.dialect.upsert(_e, values, [_e.c.name], replace, true()))

    async def delete_engine(self, name: str) -> bool:
        async with self.writing() as conn:
            done = await conn.execute(delete(_e).where(_e.c.name == name))
        return done.rowcount == 1
