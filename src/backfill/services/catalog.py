"""The model catalog and private deployments, stored in the database (SPEC §7.2)."""

from __future__ import annotations

from collections.abc import Iterable

from backfill.domain.catalog import CatalogModel
from backfill.errors import InvalidInput, NotFound
from backfill.ports import Clock, Store


class CatalogService:
    """Reads are straight from the store: the table is small and price changes show at once."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        for model in await self._store.list_models():
            if model.id == name:
                return model if org_id is None or model.visible_to(org_id) else None
        return None

    async def all(self, org_id: str | None = None) -> list[CatalogModel]:
        models = await self._store.list_models()
        return [m for m in models if org_id is None or m.visible_to(org_id)]

    async def seed(self, models: Iterable[CatalogModel]) -> None:
        """Add configured models the database does not have yet; existing rows are kept, so
        changes made through the admin API survive restarts."""
        now = int(self._clock.now())
        for model in models:
            await self._store.upsert_model(model, now, replace=False)

    async def put(self, model: CatalogModel) -> CatalogModel:
        if model.context_length < 1 or model.max_output_tokens < 1:
            raise InvalidInput(
                "context_length and max_output_tokens must be positive.",
                code="invalid_value",
                param="context_length",
            )
        prices = model.prices
        if prices and min(prices.input, prices.cached_input, prices.output) < 0:
            raise InvalidInput("Prices cannot be negative.", code="invalid_value", param="pricing")
        await self._store.upsert_model(model, int(self._clock.now()), replace=True)
        found = await self.find(model.id)
        if found is None:  # pragma: no cover - the upsert just wrote it
            raise NotFound(f"Model {model.id!r} vanished.")
        return found
