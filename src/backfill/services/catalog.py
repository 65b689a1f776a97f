"""The model catalog and private deployments, stored in the database (SPEC §7.2)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from backfill.domain.catalog import MAX_ALIASES, CatalogModel
from backfill.domain.endpoints import ENDPOINTS, MODALITIES
from backfill.domain.money import MAX_GPU_SECOND_PRICE, MAX_GPUS, MAX_TOKEN_PRICE, MAX_TOKENS
from backfill.errors import Conflict, InvalidInput, NotFound
from backfill.ports import CatalogStore, Clock
from backfill.services.tenants import printable
from backfill.settings import changed_model

MAX_MODEL_ID_CHARS = 256
MAX_THROUGHPUT = 10**9

log = logging.getLogger("backfill.catalog")


def _within(value: int | None, low: int, high: int, param: str, unit: str) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidInput(
            f"'{param}' must be from {low} to {high} {unit} (it is {value}).",
            code="invalid_value",
            param=param,
        )


def _one_of(values: frozenset[str], known: frozenset[str], param: str) -> None:
    unknown = sorted(values - known)
    if unknown or not values:
        raise InvalidInput(
            f"'{param}' must be a non-empty list of {', '.join(sorted(known))} (unknown: "
            f"{', '.join(unknown) or 'none given'}).",
            code="invalid_value",
            param=param,
        )


def _check(model: CatalogModel) -> None:
    """Bounds that keep every price, charge and limit inside its column (SPEC §7.3)."""
    printable(model.id, "model", MAX_MODEL_ID_CHARS)
    printable(model.model_config_id, "model_config_id", MAX_MODEL_ID_CHARS)
    _check_aliases(model)
    _one_of(model.modalities, MODALITIES, "modalities")
    _one_of(model.endpoints, ENDPOINTS, "endpoints")
    if "text" not in model.modalities:
        raise InvalidInput(
            "'modalities' must include 'text'; image and audio are parts of chat messages that "
            "also carry text.",
            code="invalid_value",
            param="modalities",
        )
    _within(model.context_length, 1, MAX_TOKENS, "context_length", "tokens")
    _within(model.max_output_tokens, 1, MAX_TOKENS, "max_output_tokens", "tokens")
    unit = "uUSD per million tokens"
    if model.prices:
        _within(model.prices.input, 0, MAX_TOKEN_PRICE, "pricing.input", unit)
        _within(model.prices.cached_input, 0, MAX_TOKEN_PRICE, "pricing.cached_input", unit)
        _within(model.prices.output, 0, MAX_TOKEN_PRICE, "pricing.output", unit)
    _within(model.throughput_tokens_per_s, 1, MAX_THROUGHPUT, "throughput_tokens_per_s", "/s")
    if model.owner_org_id is not None:
        _within(model.gpu_count, 1, MAX_GPUS, "gpu_count", "GPUs")
        _within(
            model.microusd_per_gpu_second,
            0,
            MAX_GPU_SECOND_PRICE,
            "microusd_per_gpu_second",
            "uUSD",
        )


def _check_aliases(model: CatalogModel) -> None:
    if model.private and model.aliases:
        raise InvalidInput(
            "A private deployment has no aliases: its id is the one name its organization "
            "uses. Aliases are for catalog models.",
            code="invalid_value",
            param="aliases",
        )
    if len(model.aliases) > MAX_ALIASES:
        raise InvalidInput(
            f"A model has at most {MAX_ALIASES} aliases ({len(model.aliases)} given).",
            code="invalid_value",
            param="aliases",
        )
    for alias in sorted(model.aliases):
        printable(alias, "aliases", MAX_MODEL_ID_CHARS)
    if model.id in model.aliases:
        raise InvalidInput(
            f"{model.id!r} is the model's id; an alias is another name for it.",
            code="invalid_value",
            param="aliases",
        )


class CatalogService:
    """Reads are straight from the store: the table is small and price changes show at once."""

    def __init__(self, store: CatalogStore, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        """The entry whose id is ``name`` (aliases are not ids: ``resolve`` reads them)."""
        return await self._first(lambda model: model.id == name, org_id)

    async def resolve(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        """The entry ``name`` means, by its id or one of its aliases (exact, case-sensitive),
        as ``org_id`` sees it."""
        return await self._first(lambda model: name in model.names, org_id)

    async def _first(
        self, match: Callable[[CatalogModel], bool], org_id: str | None
    ) -> CatalogModel | None:
        for model in await self._store.list_models():
            if match(model):
                return model if org_id is None or model.visible_to(org_id) else None
        return None

    async def change(self, model_id: str, changes: Mapping[str, Any]) -> CatalogModel:
        """Change some fields of the public catalog model ``model_id`` (as the settings name
        them), keeping the others; the entry as stored after."""
        return await self.put(changed_model(await self.catalog_model(model_id), changes))

    async def catalog_model(self, model_id: str) -> CatalogModel:
        """The public catalog model ``model_id`` (by its id), to change; NotFound otherwise."""
        found = await self.find(model_id)
        if found is None or found.private:
            where = (
                f"; it is a private deployment (PUT /admin/v1/deployments/{model_id})"
                if found is not None
                else " (GET /admin/v1/models lists them; an alias is not an id)"
            )
            raise NotFound(
                f"No catalog model has the id {model_id!r}{where}.",
                code="model_not_found",
                param="model",
            )
        return found

    async def all(self, org_id: str | None = None) -> list[CatalogModel]:
        models = await self._store.list_models()
        return [m for m in models if org_id is None or m.visible_to(org_id)]

    async def seed(self, models: Iterable[CatalogModel]) -> None:
        """Add configured models the database does not have yet; existing rows are kept, so
        changes made through the admin API survive restarts."""
        now = int(self._clock.now())
        for model in models:
            try:
                _check_aliases(model)
                await self._store.upsert_model(model, now, replace=False)
            except (Conflict, InvalidInput) as exc:
                # One entry of the file must not keep the others, or the server, from starting.
                log.warning("configured model %s skipped: %s", model.id, exc.message)

    async def put(self, model: CatalogModel) -> CatalogModel:
        """Create or change a catalog model or a private deployment; an id the other kind, or
        another org's deployment, already holds is a Conflict (nothing is written), as is an
        id that is another model's alias; an alias another entry has (as its id or alias) is
        a 400 ``alias_taken``. The aliases given replace the entry's aliases."""
        _check(model)
        before = await self._store.upsert_model(model, int(self._clock.now()), replace=True)
        if before is not None and before.owner_org_id != model.owner_org_id:
            raise _taken(before, model)
        found = await self.find(model.id)
        if found is None:  # pragma: no cover - the upsert just wrote it
            raise NotFound(f"Model {model.id!r} vanished.")
        return found


def _taken(before: CatalogModel, wanted: CatalogModel) -> Conflict:
    """Why ``wanted`` may not replace ``before``: an entry never moves between the public
    catalog and a private deployment, nor between orgs, on a PUT that reuses its id (the
    2026-12-05 review, finding L5)."""
    name = before.id
    if before.owner_org_id is None:
        return Conflict(
            f"{name!r} is a catalog model, which every organization can use; a private "
            "deployment cannot take its id, or the model would vanish for the others. Give "
            "the deployment another id (GET /admin/v1/models lists the ids in use).",
            code="model_id_taken",
        )
    if wanted.owner_org_id is None:
        return Conflict(
            f"{name!r} is a private deployment of organization {before.owner_org_id}; a "
            "catalog model cannot take its id, or every organization would see the "
            "deployment. Give the catalog model another id (GET /admin/v1/models lists the "
            "ids in use).",
            code="model_id_taken",
        )
    return Conflict(
        f"{name!r} is a private deployment of organization {before.owner_org_id}; it cannot "
        f"move to organization {wanted.owner_org_id}. Give the new deployment another id "
        "(GET /admin/v1/models lists the ids in use).",
        code="model_id_taken",
    )
