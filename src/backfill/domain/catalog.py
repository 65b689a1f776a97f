"""Catalog entries as the domain sees them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CatalogModel:
    id: str
    model_config_id: str
    context_length: int
    max_output_tokens: int
    modalities: frozenset[str] = field(default_factory=lambda: frozenset({"text"}))
    batch: bool = True
