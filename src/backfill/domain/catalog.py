"""Catalog entries as the domain sees them: public model revisions and private deployments."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS
from backfill.domain.money import Prices


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
