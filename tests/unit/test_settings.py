"""Settings: where each value comes from, and the catalog entries they describe."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from backfill.adapters.fetch import FetchPolicy
from backfill.domain.catalog import CatalogModel
from backfill.domain.money import Prices
from backfill.settings import (
    FLAT_KEYS,
    DeploymentSettings,
    EngineSettings,
    ModelSettings,
    OutboundPolicy,
    PricingSettings,
    Settings,
    catalog_model_from,
)
from tests.tls_support import make_pki


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
    assert (settings.port, settings.host, settings.limits.max_lines) == (9002, "10.0.0.2", 7)


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
    assert Settings.from_file(other).limits.max_lines == 1_000_000  # only the file it was given


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
    assert Settings().http.forwarded_allow_ips == []
    listed = ["10.0.0.5", "10.1.0.0/16", "::1"]
    assert Settings(forwarded_allow_ips=listed).http.forwarded_allow_ips == listed
    with pytest.raises(ValueError, match=r"'proxy\.internal' is not an IP address or network"):
        Settings(forwarded_allow_ips=["proxy.internal"])


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("BACKFILL_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_a_flat_key_in_the_file_lands_in_its_section_and_is_named_at_start(
    toml: Path, clean_env: pytest.MonkeyPatch
) -> None:
    settings = Settings.from_file(toml)
    assert settings.limits.max_lines == 7
    notice = settings.renamed_keys_notice()
    assert notice is not None
    assert "max_lines in the file is now limits.max_lines" in notice


def test_a_flat_variable_lands_in_its_section_and_is_named_at_start(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("BACKFILL_LEASE_S", "7")
    clean_env.setenv("BACKFILL_FETCH_ALLOWED_NETWORKS", '["10.1.0.0/16"]')
    settings = Settings()
    assert (settings.worker.lease_s, settings.fetch.allowed_networks) == (7.0, ["10.1.0.0/16"])
    notice = settings.renamed_keys_notice()
    assert notice is not None
    assert "BACKFILL_LEASE_S is now BACKFILL_WORKER__LEASE_S" in notice
    assert "BACKFILL_FETCH_ALLOWED_NETWORKS is now BACKFILL_FETCH__ALLOWED_NETWORKS" in notice


def test_sections_in_the_file_and_nested_variables_need_no_notice(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "nested.toml"
    path.write_text(
        '[worker]\nlease_s = 9\n\n[fetch]\nallow_http = true\n\n[smtp]\nsender = "b@x"\n'
    )
    clean_env.setenv("BACKFILL_SMTP__HOST", "mail.internal")
    settings = Settings.from_file(path)
    assert (settings.worker.lease_s, settings.fetch.allow_http) == (9.0, True)
    assert (settings.smtp.host, settings.smtp.sender) == ("mail.internal", "b@x")
    assert settings.renamed_keys_notice() is None


def test_flat_keywords_in_code_need_no_notice(clean_env: pytest.MonkeyPatch) -> None:
    settings = Settings(lease_s=3, smtp_from="b@x")
    assert (settings.worker.lease_s, settings.smtp.sender) == (3.0, "b@x")
    assert settings.renamed_keys_notice() is None


def test_old_and_new_names_keep_the_order_of_the_sources(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "both.toml"
    path.write_text("max_lines = 5\n\n[limits]\nmax_lines = 6\n")
    # Within one file the new name wins; the environment wins over the file, and keywords over both.
    assert Settings.from_file(path).limits.max_lines == 6
    clean_env.setenv("BACKFILL_MAX_LINES", "7")
    assert Settings.from_file(path).limits.max_lines == 7
    clean_env.setenv("BACKFILL_LIMITS__MAX_LINES", "8")
    assert Settings.from_file(path).limits.max_lines == 8
    assert Settings.from_file(path, max_lines=9).limits.max_lines == 9


def test_unknown_keys_are_ignored_as_before(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "unknown.toml"
    path.write_text("no_such_setting = 1\n\n[worker]\nno_such_setting = 2\n")
    clean_env.setenv("BACKFILL_NO_SUCH_SETTING", "3")
    assert Settings.from_file(path) == Settings()


def test_a_wrong_value_names_the_key_as_it_was_written(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    flat, nested = tmp_path / "flat.toml", tmp_path / "nested.toml"
    flat.write_text('lease_s = "soon"\n')
    nested.write_text('[worker]\nlease_s = "soon"\n')
    for path, loc in ((flat, ("lease_s",)), (nested, ("worker", "lease_s"))):
        with pytest.raises(ValidationError) as refused:
            Settings.from_file(path)
        assert [e["loc"] for e in refused.value.errors()] == [loc]
    clean_env.setenv("BACKFILL_FETCH_ALLOWED_NETWORKS", '["intranet"]')
    with pytest.raises(ValidationError) as refused:
        Settings()
    (error,) = refused.value.errors()
    assert error["loc"] == ("fetch_allowed_networks",)
    assert "'intranet' is not a network" in error["msg"]


def test_every_flat_key_has_one_place_in_a_section() -> None:
    places = set(FLAT_KEYS.values())
    assert len(places) == len(FLAT_KEYS)
    sections = {
        name: field.annotation
        for name, field in Settings.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    fields = {(name, f) for name, model in sections.items() for f in model.model_fields}
    assert places <= fields
    # No flat name is also a general setting's: it would be read twice.
    assert not set(FLAT_KEYS) & set(Settings.model_fields)
    assert len(places) == 69  # every setting that had a flat name before the sections


def test_image_fetches_and_webhooks_share_one_outbound_policy(tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(make_pki().ca_pem)
    settings = Settings(
        fetch_allow_private=True,
        webhook_allow_http=True,
        webhook_allowed_networks=["10.1.0.0/16"],
        webhook_ca_file=ca_file,
        webhook_timeout_s=4.0,
    )
    assert isinstance(settings.fetch, OutboundPolicy)
    assert isinstance(settings.webhooks, OutboundPolicy)
    hooks = FetchPolicy.outbound(
        settings.webhooks, max_bytes=1024, connect_timeout_s=1.0, max_redirects=0
    )
    assert (hooks.timeout_s, hooks.allow_http, hooks.allow_private) == (4.0, True, False)
    assert hooks.allowed_networks == ("10.1.0.0/16",)
    assert isinstance(hooks.ssl_context, ssl.SSLContext)
    images = FetchPolicy.outbound(settings.fetch, max_bytes=1024, connect_timeout_s=1.0)
    assert (images.allow_http, images.allow_private, images.ssl_context) == (False, True, None)


def test_an_engine_found_by_name_needs_a_name_to_resolve_and_no_single_address() -> None:
    spec = EngineSettings(
        name="qwen",
        base_url="http://qwen-7b.models.svc:8000/v1",
        models=["qwen"],
        discovery="dns",
        discovery_nameservers=["10.96.0.10", "127.0.0.1:5353", "[fd00::a]:53"],
    )
    assert spec.nameservers() == [("10.96.0.10", 53), ("127.0.0.1", 5353), ("fd00::a", 53)]
    refusals: dict[str, dict[str, Any]] = {
        "remove command": {"command": ["vllm", "serve"]},
        "remove metrics_url": {"metrics_url": "http://qwen-7b.models.svc:8000/metrics"},
        "needs base_url with the name": {"base_url": ""},
        "'dns.internal' is not an address": {"discovery_nameservers": ["dns.internal"]},
        "a TLS certificate for the name does not cover": {
            "base_url": "https://qwen-7b.models.svc:8000/v1"
        },
    }
    for message, change in refusals.items():
        values: dict[str, Any] = {"name": "qwen", "models": ["qwen"], "discovery": "dns"}
        values["base_url"] = "http://qwen-7b.models.svc:8000/v1"
        with pytest.raises(ValidationError, match=message):
            EngineSettings(**(values | change))


def test_only_an_engine_backfill_runs_can_be_started_on_demand() -> None:
    spec = EngineSettings(
        name="chat", models=["m"], command=["llama", "{port}"], on_demand=True, idle_stop_s=60
    )
    assert (spec.on_demand, spec.idle_stop_s) == (True, 60)
    with pytest.raises(ValidationError, match="on_demand starts and stops the engine's process"):
        EngineSettings(name="chat", base_url="http://e:8000/v1", models=["m"], on_demand=True)
    with pytest.raises(ValidationError, match="idle_stop_s"):
        EngineSettings(name="chat", models=["m"], command=["x"], on_demand=True, idle_stop_s=0)
