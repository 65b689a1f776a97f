"""Catalog entries as the domain sees them: public model revisions and private deployments."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS
from backfill.domain.money import Prices
from backfill.errors import BackfillError, Conflict, InvalidInput

# Aliases one catalog model may have: names people already use for it, not a namespace.
MAX_ALIASES = 16


class Billing(StrEnum):
    """How a batch (and each receipt) is charged."""

    CATALOG = "catalog"
    """Per token at the model revision's published batch prices."""
    GPU_TIME = "gpu_time"
    """Per GPU-second of a private deployment, whatever runs on it."""


@dataclass(frozen=True, slots=True)
class CatalogModel:
    """A model revision requests can name in ``body.model``.

    A public revision is batch-qualified when it has batch ``prices``. A private deployment
    belongs to ``owner_org_id``, is billed by GPU time and has no token prices.
    """

    id: str
    model_config_id: str
    context_length: int
    max_output_tokens: int
    modalities: frozenset[str] = field(default_factory=lambda: frozenset({"text"}))
    prices: Prices | None = None
    owner_org_id: str | None = None
    gpu_count: int = 0
    microusd_per_gpu_second: int = 0
    throughput_tokens_per_s: int | None = None
    endpoints: frozenset[str] = DEFAULT_MODEL_ENDPOINTS
    """The batch endpoints (``/v1/chat/completions``, ...) its engines serve."""
    aliases: frozenset[str] = frozenset()
    """Other names a request line's ``body.model`` may use for it: exact, case-sensitive
    matches, resolved to ``id`` when a file is uploaded (docs/api.md, "Model aliases")."""

    @property
    def names(self) -> frozenset[str]:
        """Every name that means this model: its id and its aliases."""
        return self.aliases | {self.id}

    @property
    def private(self) -> bool:
        return self.owner_org_id is not None

    @property
    def batch(self) -> bool:
        return self.private or self.prices is not None

    @property
    def billing(self) -> Billing:
        return Billing.GPU_TIME if self.private else Billing.CATALOG

    def visible_to(self, org_id: str) -> bool:
        return self.owner_org_id is None or self.owner_org_id == org_id


def by_name(models: Iterable[CatalogModel]) -> dict[str, CatalogModel]:
    """Each model under every name it has (its id and its aliases), for resolving a line's
    ``body.model``. Names are unique across the catalog (the store keeps them so), so no
    name is overwritten."""
    return {name: model for model in models for name in model.names}


def name_clash(
    model: CatalogModel, others: Iterable[CatalogModel]
) -> tuple[str, CatalogModel] | None:
    """The first of ``model``'s names (in sorted order) that another entry of ``others`` has
    as its id or an alias, and that entry; None when every name is free. An entry with
    ``model``'s own id is ``model`` itself (before a change) and is skipped."""
    holders: Mapping[str, CatalogModel] = by_name(o for o in others if o.id != model.id)
    for name in sorted(model.names):
        holder = holders.get(name)
        if holder is not None:
            return name, holder
    return None


def name_taken(name: str, wanted: str, holder: str) -> BackfillError:
    """Why the entry ``wanted`` may not have ``name``, which the entry ``holder`` has (as its
    id, or as an alias): a 409 when ``name`` is ``wanted``'s own id (the id a PUT names is in
    use), a 400 naming ``aliases`` when it is an alias being set."""
    kind = "the id" if name == holder else "an alias"
    if name == wanted:
        return Conflict(
            f"{name!r} is {kind} of model {holder!r}: one name means one model, so no entry "
            f"can take it as its id. Remove the alias from {holder!r} first (PATCH "
            f"/admin/v1/models/{holder} with the aliases it keeps), or give this entry "
            "another id.",
            code="model_id_taken",
        )
    return InvalidInput(
        f"Alias {name!r} is {kind} of model {holder!r}: one name means one model. Choose "
        f"another alias for {wanted!r}"
        + (f", or remove it from {holder!r} first." if name != holder else "."),
        code="alias_taken",
        param="aliases",
    )
