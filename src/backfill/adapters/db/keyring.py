"""The master-key check value, the blob-format floor, and the files they guard."""

from __future__ import annotations

from sqlalchemy import exists, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.files import FileStatus
from backfill.domain.records import KeyringRecord

# One row: the key of this database's content. A table rather than a setting so that every
# process of a scale-out deployment checks its key against the same value.
_ROW = "master"


class KeyringQueries(SqlBase):
    async def keyring(self) -> KeyringRecord | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(t.keyring).where(t.keyring.c.id == _ROW))).first()
        if row is None:
            return None
        return KeyringRecord(row.check_value, row.min_blob_format, row.created_at)

    async def init_keyring(self, record: KeyringRecord) -> KeyringRecord:
        try:
            async with self.engine.begin() as conn:
                await conn.execute(
                    insert(t.keyring).values(
                        id=_ROW,
                        check_value=record.check_value,
                        min_blob_format=record.min_blob_format,
                        created_at=record.created_at,
                    )
                )
        except IntegrityError:
            pass  # another process started at the same moment and stored its key first
        stored = await self.keyring()
        assert stored is not None  # inserted above, and never deleted
        return stored

    async def set_min_blob_format(self, version: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.keyring).where(t.keyring.c.id == _ROW).values(min_blob_format=version)
            )

    async def holds_content(self) -> bool:
        async with self.engine.connect() as conn:
            query = select(or_(exists().select_from(t.files), exists().select_from(t.batches)))
            return bool((await conn.execute(query)).scalar_one())

    async def stored_file_ids(self, after: str | None, limit: int) -> list[str]:
        query = select(t.files.c.id).where(t.files.c.status != FileStatus.DELETED)
        if after is not None:
            query = query.where(t.files.c.id > after)
        async with self.engine.connect() as conn:
            rows = await conn.execute(query.order_by(t.files.c.id).limit(limit))
            return [row.id for row in rows]
