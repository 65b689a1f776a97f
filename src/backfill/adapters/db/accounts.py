"""Organizations, API keys, the catalog, credit and receipts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import model_of, org_of, receipt_of, receipt_values
from backfill.adapters.db.spend_caps import add_gpu_spend
from backfill.adapters.db.sums import joined, sum_halves
from backfill.domain import ids
from backfill.domain.catalog import CatalogModel, name_taken
from backfill.domain.money import (
    MAX_BALANCE,
    MAX_BALANCE_USD,
    MAX_CREDIT,
    MAX_CREDIT_USD,
    pico_to_usd,
)
from backfill.domain.records import ApiKey, Ledger, Org, Receipt
from backfill.errors import Conflict, InvalidInput, NotFound

# Every authenticated request's read, built once.
_KEY_BY_HASH = select(t.api_keys).where(t.api_keys.c.secret_hash == bindparam("secret_hash"))

log = logging.getLogger("backfill.db")


async def _exact_sum(conn: AsyncConnection, column: Any, where: Any) -> tuple[int, int]:
    """``SUM(column)`` without int64 overflow (``sums.py``), and the row count, in one
    statement."""
    high, low = sum_halves(column)
    row = (await conn.execute(select(high, low, func.count()).where(where))).one()
    return joined(row[0], row[1]), int(row[2])


def _key_of(row: Any) -> ApiKey:
    return ApiKey(
        id=row.id,
        org_id=row.org_id,
        prefix=row.prefix,
        scopes=frozenset(row.scopes.split(",")),
        name=row.name,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


class AccountQueries(SqlBase):
    # ---- tenants ----------------------------------------------------------------------

    async def create_org(self, org: Org) -> None:
        async with self.writing() as conn:
            try:
                await conn.execute(
                    insert(t.orgs).values(
                        id=org.id, name=org.name, created_at=org.created_at, weight=org.weight
                    )
                )
            except IntegrityError as exc:
                raise Conflict(f"An organization named {org.name!r} already exists.") from exc

    async def org_by_name(self, name: str) -> Org | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(t.orgs).where(t.orgs.c.name == name))).first()
        return org_of(row) if row else None

    async def set_org_weight(self, org_id: str, weight: int) -> Org | None:
        o = t.orgs
        async with self.writing() as conn:
            # Claims read the weight as they split: the next claim after this commit uses it.
            row = (
                await conn.execute(
                    update(o).where(o.c.id == org_id).values(weight=weight).returning(*o.c)
                )
            ).first()
        return org_of(row) if row else None

    async def count_orgs(self) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(t.orgs))).scalar_one())

    async def create_api_key(self, key: ApiKey, secret_hash: str) -> None:
        async with self.writing() as conn:
            await conn.execute(
                insert(t.api_keys).values(
                    id=key.id,
                    org_id=key.org_id,
                    prefix=key.prefix,
                    secret_hash=secret_hash,
                    scopes=",".join(sorted(key.scopes)),
                    name=key.name,
                    created_at=key.created_at,
                )
            )

    async def api_key_by_hash(self, secret_hash: str) -> ApiKey | None:
        async with self.reads.connect() as conn:
            row = (await conn.execute(_KEY_BY_HASH, {"secret_hash": secret_hash})).first()
        return _key_of(row) if row else None

    async def list_api_keys(self, org_id: str) -> list[ApiKey]:
        k = t.api_keys
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(k).where(k.c.org_id == org_id).order_by(k.c.created_at, k.c.id)
                )
            ).all()
        return [_key_of(r) for r in rows]

    async def api_key_by_id(self, key_id: str) -> ApiKey | None:
        k = t.api_keys
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(k).where(k.c.id == key_id))).first()
        return _key_of(row) if row else None

    async def revoke_api_key(self, key_id: str, now: int) -> ApiKey | None:
        k = t.api_keys
        async with self.writing() as conn:
            await conn.execute(
                update(k).where(k.c.id == key_id, k.c.revoked_at.is_(None)).values(revoked_at=now)
            )
            row = (await conn.execute(select(k).where(k.c.id == key_id))).first()
        return _key_of(row) if row else None

    async def touch_api_key(self, key_id: str, now: int, resolution_s: int) -> None:
        k = t.api_keys
        try:
            async with self.engine.begin() as conn:
                # The condition makes concurrent requests of one key write once per interval.
                await conn.execute(
                    update(k)
                    .where(
                        k.c.id == key_id,
                        or_(k.c.last_used_at.is_(None), k.c.last_used_at <= now - resolution_s),
                    )
                    .values(last_used_at=now)
                )
        except SQLAlchemyError:
            # A bookkeeping column: a busy or full database must not turn a valid key away.
            log.warning("could not record the use of API key %s", key_id, exc_info=True)

    # ---- catalog ----------------------------------------------------------------------

    async def list_models(self) -> list[CatalogModel]:
        n = t.model_names
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(t.models).order_by(t.models.c.id))).all()
            names = (
                await conn.execute(select(n.c.name, n.c.model_id).where(n.c.name != n.c.model_id))
            ).all()
        aliases: dict[str, set[str]] = {}
        for name in names:
            aliases.setdefault(name.model_id, set()).add(name.name)
        return [model_of(r, frozenset(aliases.get(r.id, ()))) for r in rows]

    async def upsert_model(
        self, model: CatalogModel, now: int, *, replace: bool
    ) -> CatalogModel | None:
        prices = model.prices
        values: dict[str, Any] = {
            "model_config_id": model.model_config_id,
            "context_length": model.context_length,
            "max_output_tokens": model.max_output_tokens,
            "modalities": ",".join(sorted(model.modalities)),
            "price_input": prices.input if prices else None,
            "price_cached_input": prices.cached_input if prices else None,
            "price_output": prices.output if prices else None,
            "owner_org_id": model.owner_org_id,
            "gpu_count": model.gpu_count,
            "microusd_per_gpu_second": model.microusd_per_gpu_second,
            "throughput_tokens_per_s": model.throughput_tokens_per_s,
            "endpoints": ",".join(sorted(model.endpoints)),
            "updated_at": now,
        }
        m = t.models
        async with self.writing() as conn:
            # A new id is inserted; one a concurrent PUT inserted first is left to the update
            # below, like any id already there (never a unique-key error).
            inserted = await conn.execute(
                self.dialect.insert_ignoring(m).values(id=model.id, **values)
            )
            if inserted.rowcount == 1:
                await self._claim_names(conn, model)
                return None
            # Locked: the owner compared is the one the update replaces.
            query = self.dialect.for_update(select(m).where(m.c.id == model.id))
            row = (await conn.execute(query)).one()
            before = model_of(row, await self._aliases(conn, model.id))
            if replace and before.owner_org_id == model.owner_org_id:
                await conn.execute(update(m).where(m.c.id == model.id).values(**values))
                await self._claim_names(conn, model)
            return before

    @staticmethod
    async def _aliases(conn: AsyncConnection, model_id: str) -> frozenset[str]:
        n = t.model_names
        query = select(n.c.name).where(n.c.model_id == model_id, n.c.name != model_id)
        return frozenset((await conn.execute(query)).scalars())

    async def _claim_names(self, conn: AsyncConnection, model: CatalogModel) -> None:
        """Make ``model``'s names (its id and aliases) exactly those it holds; a name another
        entry holds raises (``name_taken``), rolling the whole write back."""
        n = t.model_names
        wanted = sorted(model.names)
        await conn.execute(delete(n).where(n.c.model_id == model.id, n.c.name.not_in(wanted)))
        # In one order, so two writers claiming overlapping names never wait on each other
        # crosswise; a name a concurrent writer holds is waited for, then seen as taken.
        for name in wanted:
            holder: str | None = None
            while holder is None:
                claimed = await conn.execute(
                    self.dialect.insert_ignoring(n).values(name=name, model_id=model.id)
                )
                if claimed.rowcount == 1:
                    break
                # None: its holder let it go since the insert looked (claimed again).
                query = select(n.c.model_id).where(n.c.name == name)
                holder = (await conn.execute(query)).scalar()
            if holder is not None and holder != model.id:
                raise name_taken(name, model.id, holder)

    # ---- billing ----------------------------------------------------------------------

    async def credit(self, org_id: str, amount: int, note: str | None, now: int) -> Ledger:
        if amount > MAX_CREDIT:  # the service says so first; this keeps the SQL in int64
            raise InvalidInput(
                f"A credit can be at most {MAX_CREDIT_USD} USD.", code="invalid_value", param="usd"
            )
        o = t.orgs
        async with self.writing() as conn:
            # The cap is part of the update, so two concurrent credits cannot pass it together.
            raised = await conn.execute(
                update(o)
                .where(o.c.id == org_id, o.c.balance <= MAX_BALANCE - amount)
                .values(balance=o.c.balance + amount)
            )
            if not raised.rowcount:
                balance = (await conn.execute(select(o.c.balance).where(o.c.id == org_id))).scalar()
                if balance is None:
                    raise NotFound("No such organization.")
                raise InvalidInput(
                    f"This credit would raise the balance from {pico_to_usd(balance)} to "
                    f"{pico_to_usd(balance + amount)} USD; a balance can be at most "
                    f"{MAX_BALANCE_USD} USD. Nothing was credited.",
                    code="balance_limit",
                    param="usd",
                )
            await conn.execute(
                insert(t.credits).values(
                    id=ids.credit_id(),
                    org_id=org_id,
                    amount=amount,
                    note=note,
                    created_at=now,
                )
            )
            return await self._ledger(conn, org_id)

    async def ledger(self, org_id: str) -> Ledger:
        async with self.engine.connect() as conn:
            return await self._ledger(conn, org_id)

    async def _ledger(self, conn: AsyncConnection, org_id: str) -> Ledger:
        c, r = t.credits, t.receipts
        credits, _ = await _exact_sum(conn, c.c.amount, c.c.org_id == org_id)
        charges, receipts = await _exact_sum(conn, r.c.amount, r.c.org_id == org_id)
        org = (
            await conn.execute(
                select(t.orgs.c.balance, t.orgs.c.reserved).where(t.orgs.c.id == org_id)
            )
        ).one()
        return Ledger(credits, charges, int(org.balance), int(org.reserved), int(receipts))

    async def balances(self, org_ids: Sequence[str]) -> dict[str, int]:
        if not org_ids:
            return {}
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(t.orgs.c.id, t.orgs.c.balance).where(t.orgs.c.id.in_(list(org_ids)))
                )
            ).all()
        return {r.id: int(r.balance) for r in rows}

    async def get_receipt(self, org_id: str, request_id: str) -> Receipt | None:
        r = t.receipts
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(r).where(r.c.request_id == request_id, r.c.org_id == org_id)
                )
            ).first()
        return receipt_of(row) if row else None

    async def charge_gpu_time(self, receipt: Receipt) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(t.receipts).values(**receipt_values(receipt)))
            await add_gpu_spend(
                conn, self.dialect, receipt.org_id, receipt.amount, receipt.created_at
            )
            await conn.execute(
                update(t.orgs)
                .where(t.orgs.c.id == receipt.org_id)
                .values(balance=t.orgs.c.balance - receipt.amount)
            )
