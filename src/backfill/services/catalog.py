"""The model catalog, read from settings."""

from __future__ import annotations

from collections.abc import Iterable

from backfill.domain.catalog import CatalogModel


class StaticCatalog:
    def __init__(self, models: Iterable[CatalogModel]) -> None:
        self._models = {m.id: m for m in models}

    def find(self, name: str) -> CatalogModel | None:
        return self._models.get(name)

    def all(self) -> list[CatalogModel]:
        return list(self._models.values())
