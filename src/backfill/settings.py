"""One Settings object, read from a TOML file and ``BACKFILL_*`` variables, passed explicitly."""

from __future__ import annotations

import ipaddress
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, overload

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from backfill.domain.catalog import CatalogModel
from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS, EMBEDDINGS_URL
from backfill.domain.money import Prices
from backfill.domain.scheduling.concurrency import Mode

LOCAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOCAL_ENGINE = "local-llama-cpp"
# The bundled GGUF again, served by a second llama.cpp process in embedding mode: a catalog
# entry of its own, since a batch pins one model and the engine that serves it.
LOCAL_EMBEDDING_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-embedding"
LOCAL_EMBEDDING_ENGINE = "local-llama-cpp-embedding"
LOCAL_CONTEXT = 2048
# The admin token is the one secret a person picks (API keys are 256 random bits), so it has a
# floor: 32 characters, such as the output of `openssl rand -hex 32`.
MIN_ADMIN_TOKEN_CHARS = 32
# What a model or deployment offers when it does not say: the TOML file, the admin API and the
# CLI describe catalog entries alike.
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_MAX_OUTPUT_TOKENS = 4096
DEFAULT_MODALITIES = ("text",)


def default_modalities() -> list[str]:
    return list(DEFAULT_MODALITIES)


def default_endpoints() -> list[str]:
    return sorted(DEFAULT_MODEL_ENDPOINTS)


# The file Settings.from_file reads. pydantic-settings builds its sources in a classmethod that
# takes no argument of ours, so the path reaches it through this context variable: scoped to the
# one call, where writing BACKFILL_CONFIG would change the environment of the whole process.
_toml_file: ContextVar[Path | None] = ContextVar("backfill_toml_file", default=None)


class PricingSettings(BaseModel):
    """Batch prices in microdollars per million tokens (integers, e.g. ``"150000"``)."""

    input: int
    cached_input: int | None = None
    output: int


class ModelSettings(BaseModel):
    """A catalog model revision; ``batch = null`` (absent) means not batch-qualified."""

    id: str
    model_config_id: str
    context_length: int = DEFAULT_CONTEXT_LENGTH
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    modalities: list[str] = Field(default_factory=default_modalities)
    batch: PricingSettings | None = None
    throughput_tokens_per_s: int | None = None
    # The batch endpoints its engines serve (e.g. add "/v1/responses" for vLLM, or list only
    # "/v1/embeddings" for an embedding model).
    endpoints: list[str] = Field(default_factory=default_endpoints)


class DeploymentSettings(BaseModel):
    """A private deployment: one org's engines serving one revision, billed by GPU time."""

    id: str
    org: str
    model_config_id: str
    gpu_count: int = 1
    microusd_per_gpu_second: int
    context_length: int = DEFAULT_CONTEXT_LENGTH
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    modalities: list[str] = Field(default_factory=default_modalities)
    endpoints: list[str] = Field(default_factory=default_endpoints)


@overload
def catalog_model_from(spec: ModelSettings) -> CatalogModel: ...
@overload
def catalog_model_from(spec: DeploymentSettings, owner_org_id: str) -> CatalogModel: ...
def catalog_model_from(
    spec: ModelSettings | DeploymentSettings, owner_org_id: str | None = None
) -> CatalogModel:
    """The catalog entry a model revision describes, or a deployment owned by ``owner_org_id``
    (the id of the org its settings name)."""
    if isinstance(spec, DeploymentSettings):
        return CatalogModel(
            id=spec.id,
            model_config_id=spec.model_config_id,
            context_length=spec.context_length,
            max_output_tokens=spec.max_output_tokens,
            modalities=frozenset(spec.modalities),
            endpoints=frozenset(spec.endpoints),
            owner_org_id=owner_org_id,
            gpu_count=spec.gpu_count,
            microusd_per_gpu_second=spec.microusd_per_gpu_second,
        )
    pricing = spec.batch
    return CatalogModel(
        id=spec.id,
        model_config_id=spec.model_config_id,
        context_length=spec.context_length,
        max_output_tokens=spec.max_output_tokens,
        modalities=frozenset(spec.modalities),
        prices=Prices.of(pricing.input, pricing.cached_input, pricing.output) if pricing else None,
        throughput_tokens_per_s=spec.throughput_tokens_per_s,
        endpoints=frozenset(spec.endpoints),
    )


class EngineSettings(BaseModel):
    """An OpenAI-compatible engine that serves one or more catalog models."""

    name: str
    base_url: str = ""
    models: list[str]
    served_names: dict[str, str] = Field(default_factory=dict)
    max_concurrency: int = 16
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    api_key: str | None = None
    # A managed engine is started and supervised by Backfill from this command template;
    # ``{port}`` and ``{host}`` are filled in. Empty means the engine runs elsewhere.
    command: list[str] = Field(default_factory=list)
    # Shared with interactive traffic, batch work takes only what that traffic leaves
    # (docs/scheduling.md); dedicated fills up to max_concurrency.
    mode: Mode = Mode.DEDICATED
    # What a shared engine's limit follows: its metrics (auto: vLLM's or SGLang's names,
    # whichever /metrics has, else latency) or Backfill's own latency only.
    signal: Literal["auto", "vllm", "sglang", "latency"] = "auto"
    metrics_url: str | None = None
    # The engine's sequence slots (vLLM --max-num-seqs); unset: AIMD on its queue.
    slots: int | None = Field(default=None, ge=1)
    headroom: float = Field(default=2.0, ge=0)
    headroom_sigmas: float = Field(default=1.5, ge=0)
    kv_target: float = Field(default=0.9, gt=0, le=1)
    latency_tolerance: float = Field(default=1.5, gt=1)
    # vLLM's request priority for Backfill's requests (lower is served first; people's
    # requests carry 0). For an engine started with --scheduling-policy priority: batch
    # requests then queue behind people's and are preempted for them, so a shared engine
    # keeps no headroom free.
    priority: int | None = None


class Settings(BaseSettings):
    """Everything a Backfill process can be told."""

    model_config = SettingsConfigDict(
        env_prefix="BACKFILL_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    data_dir: Path = Path("backfill-data")
    database_url: str = ""
    storage_url: str = ""
    master_key: str | None = None
    # S3-compatible storage (storage_url = "s3://bucket/prefix"); credentials may also come
    # from the usual AWS environment variables.
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080

    models: list[ModelSettings] = Field(default_factory=list)
    deployments: list[DeploymentSettings] = Field(default_factory=list)
    engines: list[EngineSettings] = Field(default_factory=list)
    local_engine: bool = True
    local_engine_concurrency: int = 2
    # The embedded engine may serve people too (docs/scheduling.md); it has no metrics, so a
    # shared one follows Backfill's latency.
    local_engine_mode: Mode = Mode.DEDICATED
    # Embeddings on the bundled model (LOCAL_EMBEDDING_MODEL): "auto" starts its llama.cpp
    # process when an embeddings batch is waiting for it, "on" at start, "off" never.
    local_embeddings: Literal["auto", "on", "off"] = "auto"

    max_file_bytes: int = 256 * 1024 * 1024
    max_lines: int = 1_000_000
    max_line_bytes: int = 20 * 1024 * 1024
    # A BatchRouter sectioned file is stored expanded (each request with its section's shared
    # body and prefix messages); this bounds that, as max_file_bytes bounds what is uploaded.
    max_expanded_file_bytes: int = Field(4 * 1024**3, ge=1)
    # Image and audio parts of chat lines (SPEC §5.4), checked at upload: one inline part's
    # decoded bytes (a fetched https image is held to the same), and all of a line's parts.
    max_media_part_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_media_bytes_per_line: int = Field(16 * 1024 * 1024, ge=1)
    max_media_parts_per_line: int = Field(32, ge=1)
    # Fetching https image URLs when a request runs (SPEC §10.4, docs/security.md).
    fetch_timeout_s: float = Field(10.0, gt=0)
    fetch_connect_timeout_s: float = Field(5.0, gt=0)
    # All of one line's images together, fetched one after another.
    fetch_total_timeout_s: float = Field(60.0, gt=0)
    # Lines whose images one worker fetches at once (as many more wait for a place), before
    # they take an engine slot: a slow image host holds a fetch place, never a slot.
    fetch_concurrency: int = Field(16, ge=1, le=1024)
    # For development and tests only: plain http, and hosts on private or loopback addresses.
    fetch_allow_http: bool = False
    fetch_allow_private: bool = False
    # Networks (CIDR) fetched from even when private: an internal image store, say.
    fetch_allowed_networks: list[str] = Field(default_factory=list)
    # A PEM bundle of CAs to trust instead of the system's (a private CA in development).
    fetch_ca_file: Path | None = None
    # Notifications when a batch ends (SPEC §10.5, docs/notifications.md). Webhooks go through
    # the same address rules as image fetches, with their own switches for development.
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_attempts: int = Field(3, ge=1, le=20)
    # The n-th retry waits base * 4^(n-1) seconds, at most an hour.
    webhook_retry_base_s: float = Field(30.0, gt=0)
    webhook_allow_http: bool = False
    webhook_allow_private: bool = False
    webhook_allowed_networks: list[str] = Field(default_factory=list)
    webhook_ca_file: Path | None = None
    # How often each worker looks for notifications that are due.
    notify_interval_s: float = Field(1.0, gt=0)
    # Email: set smtp_host to send one on every terminal state to the org's address.
    smtp_host: str | None = None
    smtp_port: int = Field(587, ge=1, le=65535)
    smtp_security: Literal["starttls", "tls", "none"] = "starttls"
    smtp_username: str | None = None
    smtp_password: str | None = None
    smtp_from: str = "backfill@localhost"
    smtp_timeout_s: float = Field(30.0, gt=0)
    # A mail server may be down for a while: more attempts than a webhook gets (about 4 h).
    email_attempts: int = Field(8, ge=1, le=50)
    email_retry_base_s: float = Field(30.0, gt=0)
    # Where users reach this Backfill (for links in emails), e.g. https://batch.example.com.
    public_url: str | None = None
    min_completion_window_s: int = 24 * 3600
    max_completion_window_s: int = 168 * 3600
    input_file_ttl_s: int = 24 * 3600
    output_file_ttl_s: int = 7 * 24 * 3600

    lease_s: float = 60.0
    max_attempts: int = 5
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0
    poll_interval_s: float = 0.05
    # How long a finished result waits for others to share its commit. Each commit costs the
    # same whatever it holds; at 0.02 s a drain at 1,000 requests a second spent about a sixth
    # more CPU than at 0.05 s (docs/performance.md). No pause when no other request runs.
    result_flush_s: float = 0.05
    # A batch still validating this long after creation is started by a worker (its creating
    # process died or gave up); see runner/validating.py.
    validating_grace_s: float = 30.0
    # A failed take-over of such a batch is tried again with backoff up to this long.
    validating_retry_max_s: float = Field(60.0, gt=0)
    # How often a worker looks for batches to cancel, expire or finalize (0 would spin).
    lifecycle_interval_s: float = Field(0.2, gt=0)
    # A worker whose polls find nothing (no work to claim, no batch to finalize, no
    # notification due) polls less and less often, at last this often: what this process does
    # wakes it at once, so only another process's work (or a lease that ran out) waits that long.
    idle_poll_s: float = Field(5.0, gt=0)
    # Slots that free up within this long of each other are refilled by one claim.
    dispatch_gather_s: float = Field(0.005, ge=0)
    # Replicas of a model (engines serving the same models) claim together, and lines that
    # share a prompt prefix go to the same one, back to back (docs/scheduling.md).
    prefix_locality: bool = True
    # How often a shared engine's metrics are read while they can be.
    pressure_interval_s: float = Field(0.1, gt=0)
    # An engine that does not pass its health check is logged (a warning naming it, its URL and
    # the reason) within seconds of the worker's start, and again this often while it stays down.
    engine_down_log_interval_s: float = Field(300.0, gt=0)
    default_org_credit_usd: str = "100"
    idempotency_required: bool = False
    max_unfinished_batches: int = 4
    max_retained_input_bytes: int = 1024**3
    admin_token: str | None = None
    # When set, /metrics answers only to 'Authorization: Bearer <metrics_token>'.
    metrics_token: str | None = None
    # The HTTP edge: how much one client may make the API process hold, and for how long.
    # A zero timeout would make the connection watchdog spin; a zero size refuses everything.
    max_json_body_bytes: int = Field(1024 * 1024, ge=1)
    max_header_bytes: int = Field(64 * 1024, ge=1)
    header_timeout_s: float = Field(10.0, gt=0)
    body_idle_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(512, ge=1)
    # Failed admin_token and metrics_token authentications (401) allowed per client address
    # (IPv6: per /64) in the window; then 429 on those routes. 0: off.
    auth_failure_limit: int = 20
    auth_failure_window_s: float = 60.0
    # Addresses or networks (CIDR) of the reverse proxies whose X-Forwarded-For and
    # X-Forwarded-Proto are believed. Empty: no client's are, loopback's neither (a same-host
    # proxy that passes the client's header on unchanged would otherwise let any client choose
    # the address the authentication brake counts).
    forwarded_allow_ips: list[str] = Field(default_factory=list)

    gpu_time_flush_s: float = 1.0
    janitor_interval_s: float = 60.0
    # Scheduling (docs/scheduling.md): how often a worker measures throughput, projects running
    # batches and marks urgent lanes; a batch is urgent once projected to finish within this
    # share of its window before its deadline; refuse batches the measured rate cannot finish.
    plan_interval_s: float = Field(5.0, gt=0)
    deadline_margin_fraction: float = Field(0.1, ge=0, lt=1)
    deadline_admission: bool = True
    log_level: str = "info"

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network; list the addresses of your "
                    'reverse proxies, e.g. ["10.0.0.5", "10.1.0.0/16"]'
                ) from None
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = _toml_file.get()
        if toml is None and (config := os.environ.get("BACKFILL_CONFIG")):
            toml = Path(config)
        sources = [init_settings, env_settings]
        if toml is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml))
        return tuple(sources)

    @classmethod
    def from_file(cls, path: Path | None, **values: Any) -> Settings:
        """Settings from ``values``, then ``BACKFILL_*`` variables, then the TOML file at
        ``path`` (without one, the file ``BACKFILL_CONFIG`` names, as for ``Settings()``)."""
        token = _toml_file.set(path)
        try:
            return cls(**values)
        finally:
            _toml_file.reset(token)

    def admin_token_problem(self) -> str | None:
        """Why the configured admin token may not be used (None: it may, or it is unset)."""
        if self.admin_token and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS:
            return (
                f"admin_token is {len(self.admin_token)} characters long; use at least "
                f"{MIN_ADMIN_TOKEN_CHARS} random characters (for example the output of "
                "`openssl rand -hex 32`), or leave it empty to disable the admin API."
            )
        return None

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'backfill.db'}"

    @property
    def resolved_storage_path(self) -> Path:
        if self.storage_url.startswith("file://"):
            return Path(self.storage_url.removeprefix("file://"))
        return self.data_dir / "blobs"

    def catalog(self) -> list[ModelSettings]:
        """The configured models, plus the local SmolLM2 model when the local engine is on."""
        models = list(self.models)
        if self.local_engine and all(m.id != LOCAL_MODEL for m in models):
            models.append(
                ModelSettings(
                    id=LOCAL_MODEL,
                    model_config_id="smollm2-135m-instruct-q4_1",
                    context_length=LOCAL_CONTEXT,
                    max_output_tokens=LOCAL_CONTEXT,
                    batch=PricingSettings(input=10_000, cached_input=5_000, output=20_000),
                )
            )
        if self.serves_local_embeddings and all(m.id != LOCAL_EMBEDDING_MODEL for m in models):
            models.append(
                ModelSettings(
                    id=LOCAL_EMBEDDING_MODEL,
                    model_config_id="smollm2-135m-instruct-q4_1-embedding",
                    context_length=LOCAL_CONTEXT,
                    max_output_tokens=1,
                    endpoints=[EMBEDDINGS_URL],
                    batch=PricingSettings(input=2_000, cached_input=None, output=0),
                )
            )
        return models

    @property
    def serves_local_embeddings(self) -> bool:
        return self.local_engine and self.local_embeddings != "off"
