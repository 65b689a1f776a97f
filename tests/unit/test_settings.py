"""Settings: where each value comes from, and the catalog entries they describe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backfill.domain.catalog import CatalogModel
from backfill.domain.money import Prices
from backfill.settings import (
    DeploymentSettings,
    ModelSettings,
    PricingSettings,
    Settings,
    catalog_model_from,
)


@pytest.fixture
def toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    monkeypatch.delenv("BACKFILL_PORT", raising=False)
    monkeypatch.delenv("BACKFILL_HOST", raising=False)
    path = tmp_path / "backfill.toml"
    path.write_text('port = 9001\nhost = "10.0.0.1"\nmax_lines = 7\n')
    return path


def test_values_win_over_the_environment_which_wins_over_the_file(
    toml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BACKFILL_HOST", "10.0.0.2")
    settings = Settings.from_file(toml, port=9002)
    assert (settings.port, settings.host, settings.max_lines) == (9002, "10.0.0.2", 7)


def test_the_file_is_read_without_touching_the_environment(toml: Path) -> None:
    assert Settings.from_file(toml).port == 9001
    assert "BACKFILL_CONFIG" not in os.environ
    assert Settings().port == 8080


def test_without_a_path_backfill_config_names_the_file(
    toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BACKFILL_CONFIG", str(toml))
    assert Settings.from_file(None).port == 9001
    other = tmp_path / "other.toml"
    other.write_text("port = 9003\n")
    assert Settings.from_file(other).max_lines == 1_000_000  # only the file it was given


def test_a_model_revision_becomes_a_public_catalog_entry() -> None:
    spec = ModelSettings(
        id="m",
        model_config_id="m-1",
        modalities=["text", "image"],
        batch=PricingSettings(input=100, output=400),
        throughput_tokens_per_s=50,
    )
    assert catalog_model_from(spec) == CatalogModel(
        "m",
        "m-1",
        8192,
        4096,
        modalities=frozenset({"text", "image"}),
        prices=Prices(100, 100, 400),
        throughput_tokens_per_s=50,
    )
    assert catalog_model_from(ModelSettings(id="m", model_config_id="m-1")).prices is None


def test_a_deployment_becomes_an_entry_its_org_owns() -> None:
    spec = DeploymentSettings(
        id="d", org="acme", model_config_id="d-1", gpu_count=2, microusd_per_gpu_second=9
    )
    model = catalog_model_from(spec, "org_123")
    assert (model.owner_org_id, model.gpu_count, model.microusd_per_gpu_second) == (
        "org_123",
        2,
        9,
    )
    assert (model.context_length, model.max_output_tokens, model.modalities) == (
        8192,
        4096,
        frozenset({"text"}),
    )
    assert model.prices is None


def test_forwarded_allow_ips_takes_addresses_and_networks_only() -> None:
    assert Settings().forwarded_allow_ips == []
    listed = ["10.0.0.5", "10.1.0.0/16", "::1"]
    assert Settings(forwarded_allow_ips=listed).forwarded_allow_ips == listed
    with pytest.raises(ValueError, match=r"'proxy\.internal' is not an IP address or network"):
        Settings(forwarded_allow_ips=["proxy.internal"])
