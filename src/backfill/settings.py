"""One Settings object, read from a TOML file and ``BACKFILL_*`` variables, passed explicitly."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, overload
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from backfill.domain.catalog import CatalogModel, name_clash
from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS, EMBEDDINGS_URL
from backfill.domain.money import Prices
from backfill.domain.scheduling.concurrency import LOOK_INTERVAL_S, Mode

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
    # Other names request lines may use for it in body.model (exact, case-sensitive); a line
    # that uses one runs on this model (docs/api.md, "Model aliases").
    aliases: list[str] = Field(default_factory=list)


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
        aliases=frozenset(spec.aliases),
    )


def changed_model(model: CatalogModel, changes: Mapping[str, Any]) -> CatalogModel:
    """The public catalog model ``model`` with ``changes`` made: fields of ``ModelSettings``
    (as JSON; ``aliases`` replaces the list), the others kept as they are."""
    prices = model.prices
    batch = None
    if prices is not None:
        batch = {
            "input": prices.input,
            "cached_input": prices.cached_input,
            "output": prices.output,
        }
    current = {
        "id": model.id,
        "model_config_id": model.model_config_id,
        "context_length": model.context_length,
        "max_output_tokens": model.max_output_tokens,
        "modalities": sorted(model.modalities),
        "batch": batch,
        "throughput_tokens_per_s": model.throughput_tokens_per_s,
        "endpoints": sorted(model.endpoints),
        "aliases": sorted(model.aliases),
    }
    return catalog_model_from(ModelSettings.model_validate({**current, **changes}))


class EngineSettings(BaseModel):
    """An OpenAI-compatible engine that serves one or more catalog models."""

    name: str
    base_url: str = ""
    models: list[str]
    served_names: dict[str, str] = Field(default_factory=dict)
    max_concurrency: int = Field(default=16, ge=1)
    request_timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
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
    headroom_sigmas: float = Field(default=2.5, ge=0)
    kv_target: float = Field(default=0.9, gt=0, le=1)
    latency_tolerance: float = Field(default=1.5, gt=1)
    # How much slower people may be than without batch work (their time per output token
    # and to first token): batch sequences are capped by the engine's step time, learnt from
    # its inter-token latency (vLLM's metrics).
    latency_budget: float = Field(default=1.10, gt=1)
    # People waiting for a slot get Backfill's latest requests given back (aborted; the lines
    # go back to the queue uncharged, no attempt counted).
    give_back: bool = True
    # No people on the engine for this long: batch work takes every slot.
    idle_after_s: float = Field(default=5.0, ge=0)
    # vLLM's request priority for Backfill's requests (lower is served first; people's
    # requests carry 0). For an engine started with --scheduling-policy priority: people who
    # must wait are admitted before batch requests. vLLM never preempts a running request
    # for them, so a shared engine keeps its headroom; whether the engine applies it is
    # probed (docs/configuration.md).
    priority: int | None = None
    # Replicas found by name (docs/fleet.md): every address ``base_url``'s host resolves to
    # is one replica of this engine ("dns": A and AAAA records, with base_url's port;
    # "dns-srv": the host's SRV records, each target and port), looked up again every
    # ``discovery_interval_s``. Nameservers ("host" or "host:port") replace the system's.
    discovery: Literal["none", "dns", "dns-srv"] = "none"
    discovery_interval_s: float = Field(default=10.0, gt=0)
    discovery_nameservers: list[str] = Field(default_factory=list)
    # An engine with a command may run only while work waits for it (docs/fleet.md): started
    # when its models have lines a claim could take, stopped after ``idle_stop_s`` without a
    # request. Its start time is learnt and counted by deadlines.
    on_demand: bool = False
    idle_stop_s: float = Field(default=600.0, gt=0)
    # How the engine takes a chat line's JSON Schema: as the line sent it (OpenAI's
    # ``json_schema``: vLLM, SGLang, llama.cpp's llama-server) or rewritten as
    # ``{"type": "json_object", "schema": …}`` (llama-cpp-python's server, which refuses
    # ``json_schema``).
    json_schema_format: Literal["json_schema", "json_object"] = "json_schema"

    @model_validator(mode="after")
    def _on_demand(self) -> EngineSettings:
        if self.on_demand and not self.command:
            raise ValueError(
                f"engine {self.name!r}: on_demand starts and stops the engine's process, so it "
                "needs command; an engine that runs elsewhere is scaled by its own platform "
                "(docs/fleet.md)"
            )
        return self

    @model_validator(mode="after")
    def _discovered(self) -> EngineSettings:
        if self.discovery == "none":
            return self
        if self.command:
            raise ValueError(
                f"engine {self.name!r}: discovery finds replicas of an engine that runs "
                'elsewhere; remove command, or set discovery = "none"'
            )
        if self.metrics_url:
            raise ValueError(
                f"engine {self.name!r}: with discovery each replica's metrics are read at its "
                "own address (base_url's, /metrics); remove metrics_url"
            )
        where = urlsplit(self.base_url)
        if not where.hostname:
            raise ValueError(
                f"engine {self.name!r}: discovery needs base_url with the name to resolve, "
                'e.g. "http://qwen-7b.models.svc:8000/v1"'
            )
        if where.scheme == "https":
            raise ValueError(
                f"engine {self.name!r}: discovery calls each replica at its address, which a "
                "TLS certificate for the name does not cover; use http:// inside the cluster "
                "(a service mesh can add mTLS), or list each replica as an engine of its own"
            )
        self.nameservers()
        return self

    def nameservers(self) -> list[tuple[str, int]]:
        """``discovery_nameservers`` as (address, port); empty: the system's resolver."""
        return [_nameserver(server) for server in self.discovery_nameservers]


def _nameserver(server: str) -> tuple[str, int]:
    """A nameserver written "host" or "host:port" ("[v6]:port" for IPv6)."""
    where = urlsplit(f"//{server}")
    try:
        port = where.port or 53
        ipaddress.ip_address(where.hostname or "")
    except ValueError:
        raise ValueError(
            f"discovery nameserver {server!r} is not an address; write e.g. 10.96.0.10 or "
            "127.0.0.1:5353"
        ) from None
    return where.hostname or "", port


class OutboundPolicy(BaseModel):
    """Where Backfill's own outbound requests may go, and how long one may take: the rules
    image fetches (``[fetch]``) and webhooks (``[webhooks]``) share (SPEC §10.4,
    docs/security.md). The switches are for development and private deployments only."""

    timeout_s: float = Field(10.0, gt=0)
    # Plain http, and hosts on private or loopback addresses.
    allow_http: bool = False
    allow_private: bool = False
    # Networks (CIDR) reached even when private: an internal image store, say.
    allowed_networks: list[str] = Field(default_factory=list)
    # A PEM bundle of CAs to trust instead of the system's (a private CA in development).
    ca_file: Path | None = None

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not a network; write it in CIDR, e.g. 10.1.2.0/24"
                ) from None
        return value


class FetchSettings(OutboundPolicy):
    """Fetching https image URLs when a request runs (SPEC §10.4, docs/security.md)."""

    connect_timeout_s: float = Field(5.0, gt=0)
    # All of one line's images together, fetched one after another.
    total_timeout_s: float = Field(60.0, gt=0)
    # Lines whose images one worker fetches at once (as many more wait for a place), before
    # they take an engine slot: a slow image host holds a fetch place, never a slot.
    concurrency: int = Field(16, ge=1, le=1024)


class WebhookSettings(OutboundPolicy):
    """Webhooks when a batch ends (SPEC §10.5, docs/notifications.md)."""

    attempts: int = Field(3, ge=1, le=20)
    # The n-th retry waits base * 4^(n-1) seconds, at most an hour.
    retry_base_s: float = Field(30.0, gt=0)


class MailSettings(BaseModel):
    """Email: with ``host`` set, one is sent on every terminal state to the org's address."""

    host: str | None = None
    port: int = Field(587, ge=1, le=65535)
    security: Literal["starttls", "tls", "none"] = "starttls"
    username: str | None = None
    password: str | None = None
    # The From address.
    sender: str = "backfill@localhost"
    timeout_s: float = Field(30.0, gt=0)
    # A mail server may be down for a while: more attempts than a webhook gets (about 4 h).
    attempts: int = Field(8, ge=1, le=50)
    retry_base_s: float = Field(30.0, gt=0)


class S3Settings(BaseModel):
    """S3-compatible storage (storage_url = "s3://bucket/prefix"); credentials may also come
    from the usual AWS environment variables."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None


class LimitsSettings(BaseModel):
    """What an org may upload, ask for and keep."""

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
    # A line's ``stream: true``: refused (400 streaming_unsupported), or accepted with no
    # effect, as some hosted batch services do (the result is the whole answer either way).
    ignore_stream: bool = False
    max_unfinished_batches: int = 4
    max_retained_input_bytes: int = 1024**3
    min_completion_window_s: int = 24 * 3600
    max_completion_window_s: int = 168 * 3600
    input_file_ttl_s: int = 24 * 3600
    output_file_ttl_s: int = 7 * 24 * 3600


class WorkerSettings(BaseModel):
    """How a worker paces its loops, leases and retries (what the runner is configured by)."""

    # How long a claimed request, or a batch being finalized, stays leased without a heartbeat.
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
    # process died or gave up, or serves the API only); see runner/validating.py.
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
    # How often the engines stored for every worker are read (docs/fleet.md): an engine added,
    # changed or removed through the admin API is followed within this long.
    engine_config_poll_s: float = Field(2.0, gt=0)
    # How often a shared engine's metrics are read while they can be (why not more often:
    # LOOK_INTERVAL_S).
    pressure_interval_s: float = Field(LOOK_INTERVAL_S, gt=0)
    # An engine that does not pass its health check is logged (a warning naming it, its URL and
    # the reason) within seconds of the worker's start, and again this often while it stays
    # down; a flapping engine's outages with one reason are not warned about more often.
    engine_down_log_interval_s: float = Field(300.0, gt=0)
    gpu_time_flush_s: float = 1.0
    janitor_interval_s: float = 60.0
    # How often each worker looks for notifications that are due.
    notify_interval_s: float = Field(1.0, gt=0)
    # Where a `serve --role worker` process answers /healthz, /readyz and /metrics (on the
    # top-level host). Off by default: several workers on one machine would collide on a port.
    http_port: int | None = Field(None, ge=1, le=65535)


class SchedulingSettings(BaseModel):
    """Deadlines (docs/scheduling.md): how often a worker measures throughput, projects running
    batches and marks urgent lanes; a batch is urgent once projected to finish within this
    share of its window before its deadline; refuse batches the measured rate cannot finish."""

    plan_interval_s: float = Field(5.0, gt=0)
    deadline_margin_fraction: float = Field(0.1, ge=0, lt=1)
    deadline_admission: bool = True


class AuditSettings(BaseModel):
    """The audit log (docs/observability.md): every admin action and every key use that changes
    state is kept this many days, then removed by the retention sweep."""

    retention_days: int = Field(400, ge=1)


class HttpSettings(BaseModel):
    """The HTTP edge: how much one client may make the API process hold, and for how long.
    A zero timeout would make the connection watchdog spin; a zero size refuses everything."""

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


class TracingSettings(BaseModel):
    """OpenTelemetry traces (docs/observability.md): off until ``otlp_endpoint`` is set, then
    spans go there over OTLP/HTTP, and engines are sent the trace context of each request."""

    # The OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces.
    otlp_endpoint: str | None = None
    service_name: str = "backfill"
    # The share of traces kept (a caller's sampled flag is followed where one is sent).
    sample_ratio: float = Field(1.0, ge=0, le=1)
    # Sent with every export, e.g. {"authorization" = "Bearer …"} for a hosted collector.
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if not value:
            return None
        if urlsplit(value).scheme not in ("http", "https"):
            raise ValueError(
                f"{value!r} is not an http(s) URL; write the collector's OTLP/HTTP traces "
                "URL, e.g. http://localhost:4318/v1/traces"
            )
        return value


# The names settings had before they were grouped into sections: each still works, in the
# TOML file, as a BACKFILL_* variable and as a keyword of Settings(...), for this release.
FLAT_KEYS: Mapping[str, tuple[str, str]] = {
    "s3_endpoint_url": ("s3", "endpoint_url"),
    "s3_region": ("s3", "region"),
    "s3_access_key_id": ("s3", "access_key_id"),
    "s3_secret_access_key": ("s3", "secret_access_key"),
    "max_file_bytes": ("limits", "max_file_bytes"),
    "max_lines": ("limits", "max_lines"),
    "max_line_bytes": ("limits", "max_line_bytes"),
    "max_expanded_file_bytes": ("limits", "max_expanded_file_bytes"),
    "max_media_part_bytes": ("limits", "max_media_part_bytes"),
    "max_media_bytes_per_line": ("limits", "max_media_bytes_per_line"),
    "max_media_parts_per_line": ("limits", "max_media_parts_per_line"),
    "max_unfinished_batches": ("limits", "max_unfinished_batches"),
    "max_retained_input_bytes": ("limits", "max_retained_input_bytes"),
    "min_completion_window_s": ("limits", "min_completion_window_s"),
    "max_completion_window_s": ("limits", "max_completion_window_s"),
    "input_file_ttl_s": ("limits", "input_file_ttl_s"),
    "output_file_ttl_s": ("limits", "output_file_ttl_s"),
    "fetch_timeout_s": ("fetch", "timeout_s"),
    "fetch_connect_timeout_s": ("fetch", "connect_timeout_s"),
    "fetch_total_timeout_s": ("fetch", "total_timeout_s"),
    "fetch_concurrency": ("fetch", "concurrency"),
    "fetch_allow_http": ("fetch", "allow_http"),
    "fetch_allow_private": ("fetch", "allow_private"),
    "fetch_allowed_networks": ("fetch", "allowed_networks"),
    "fetch_ca_file": ("fetch", "ca_file"),
    "webhook_timeout_s": ("webhooks", "timeout_s"),
    "webhook_attempts": ("webhooks", "attempts"),
    "webhook_retry_base_s": ("webhooks", "retry_base_s"),
    "webhook_allow_http": ("webhooks", "allow_http"),
    "webhook_allow_private": ("webhooks", "allow_private"),
    "webhook_allowed_networks": ("webhooks", "allowed_networks"),
    "webhook_ca_file": ("webhooks", "ca_file"),
    "smtp_host": ("smtp", "host"),
    "smtp_port": ("smtp", "port"),
    "smtp_security": ("smtp", "security"),
    "smtp_username": ("smtp", "username"),
    "smtp_password": ("smtp", "password"),
    "smtp_from": ("smtp", "sender"),
    "smtp_timeout_s": ("smtp", "timeout_s"),
    "email_attempts": ("smtp", "attempts"),
    "email_retry_base_s": ("smtp", "retry_base_s"),
    "lease_s": ("worker", "lease_s"),
    "max_attempts": ("worker", "max_attempts"),
    "retry_base_s": ("worker", "retry_base_s"),
    "retry_max_s": ("worker", "retry_max_s"),
    "poll_interval_s": ("worker", "poll_interval_s"),
    "result_flush_s": ("worker", "result_flush_s"),
    "validating_grace_s": ("worker", "validating_grace_s"),
    "validating_retry_max_s": ("worker", "validating_retry_max_s"),
    "lifecycle_interval_s": ("worker", "lifecycle_interval_s"),
    "idle_poll_s": ("worker", "idle_poll_s"),
    "dispatch_gather_s": ("worker", "dispatch_gather_s"),
    "prefix_locality": ("worker", "prefix_locality"),
    "pressure_interval_s": ("worker", "pressure_interval_s"),
    "engine_down_log_interval_s": ("worker", "engine_down_log_interval_s"),
    "gpu_time_flush_s": ("worker", "gpu_time_flush_s"),
    "janitor_interval_s": ("worker", "janitor_interval_s"),
    "notify_interval_s": ("worker", "notify_interval_s"),
    "plan_interval_s": ("scheduling", "plan_interval_s"),
    "deadline_margin_fraction": ("scheduling", "deadline_margin_fraction"),
    "deadline_admission": ("scheduling", "deadline_admission"),
    "max_json_body_bytes": ("http", "max_json_body_bytes"),
    "max_header_bytes": ("http", "max_header_bytes"),
    "header_timeout_s": ("http", "header_timeout_s"),
    "body_idle_timeout_s": ("http", "body_idle_timeout_s"),
    "max_connections": ("http", "max_connections"),
    "auth_failure_limit": ("http", "auth_failure_limit"),
    "auth_failure_window_s": ("http", "auth_failure_window_s"),
    "forwarded_allow_ips": ("http", "forwarded_allow_ips"),
}

# The sources put the flat keys they met here (the file's and the environment's), for the
# validator to take out: it names them in the deprecation notice and in validation errors.
_FILE_FLAT = "__flat_keys_in_file__"
_ENV_FLAT = "__flat_keys_in_env__"
_ENV_PREFIX = "BACKFILL_"


def _nest(data: dict[str, Any], *, flat_wins: bool) -> list[str]:
    """Move each flat key of ``data`` into its section, in place; the keys moved.

    ``flat_wins`` decides when one source gives a setting under both names: the file and the
    environment keep the new name's value; keywords in code, the highest source, reach the
    validator after the sources are merged, so their flat value is the one asked for."""
    moved = [key for key in data if key in FLAT_KEYS]
    for key in moved:
        section_name, field = FLAT_KEYS[key]
        section = data.get(section_name)
        if isinstance(section, BaseModel):
            section = section.model_dump(exclude_unset=True)
        nested = dict(section) if isinstance(section, Mapping) else {}
        value = data.pop(key)
        if flat_wins or field not in nested:
            nested[field] = value
        data[section_name] = nested
    return moved


class _FlatKeysInFile(TomlConfigSettingsSource):
    """The TOML file, its flat keys moved into their sections."""

    def __call__(self) -> dict[str, Any]:
        data = dict(super().__call__())
        if moved := _nest(data, flat_wins=False):
            data[_FILE_FLAT] = moved
        return data


class _FlatKeysInEnv(EnvSettingsSource):
    """``BACKFILL_*`` variables, a flat name read as its nested one (``BACKFILL_LEASE_S`` as
    ``BACKFILL_WORKER__LEASE_S``) unless that is set too."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env_vars = dict(super()._load_env_vars())
        self.flat_keys: list[str] = []

        def named(key: str) -> str:
            name = f"{_ENV_PREFIX}{key}"
            return name if self.case_sensitive else name.lower()

        for flat, (section, field) in FLAT_KEYS.items():
            if (value := env_vars.get(named(flat))) is not None:
                self.flat_keys.append(flat)
                env_vars.setdefault(named(f"{section}__{field}"), value)
        return env_vars

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        if self.flat_keys:
            data[_ENV_FLAT] = list(self.flat_keys)
        return data


def _new_name(flat: str) -> str:
    section, field = FLAT_KEYS[flat]
    return f"{section}.{field}"


def _env_name(name: str) -> str:
    """The variable that sets ``name`` (``worker.lease_s``: ``BACKFILL_WORKER__LEASE_S``)."""
    return _ENV_PREFIX + name.replace(".", "__").upper()


def _as_written(exc: ValidationError, flat_keys: Collection[str]) -> ValidationError:
    """``exc`` with each setting given under its flat name named so, as the user wrote it."""
    written = {FLAT_KEYS[key]: key for key in flat_keys}
    errors: list[InitErrorDetails] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        if len(loc) >= 2 and (name := written.get((str(loc[0]), str(loc[1])))) is not None:
            loc = (name, *loc[2:])
        details = InitErrorDetails(type=error["type"], loc=loc, input=error["input"])
        if "ctx" in error:
            details["ctx"] = error["ctx"]
        errors.append(details)
    return ValidationError.from_exception_data(exc.title, errors)


class Settings(BaseSettings):
    """Everything a Backfill process can be told: a few general settings, then one section per
    concern (``settings.worker.lease_s``; ``[worker]`` in the file, ``BACKFILL_WORKER__LEASE_S``
    in the environment)."""

    model_config = SettingsConfigDict(
        env_prefix=_ENV_PREFIX,
        env_nested_delimiter="__",
        extra="ignore",
    )

    data_dir: Path = Path("backfill-data")
    database_url: str = ""
    storage_url: str = ""
    master_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    # Where users reach this Backfill (for links in emails), e.g. https://batch.example.com.
    public_url: str | None = None
    admin_token: str | None = None
    # When set, /metrics answers only to 'Authorization: Bearer <metrics_token>'.
    metrics_token: str | None = None
    default_org_credit_usd: str = "100"
    idempotency_required: bool = False
    log_level: str = "info"
    # "json": one JSON object a line (time, level, logger, message, request_id, trace_id).
    log_format: Literal["text", "json"] = "text"

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

    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    fetch: FetchSettings = Field(default_factory=FetchSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    smtp: MailSettings = Field(default_factory=MailSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)

    # The flat names the file and the environment used (for the notice at start).
    _flat_in_file: tuple[str, ...] = PrivateAttr(default=())
    _flat_in_env: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _sections(cls, data: Any, handler: ModelWrapValidatorHandler[Settings]) -> Settings:
        if not isinstance(data, dict):
            return handler(data)
        data = dict(data)
        in_file = [str(key) for key in data.pop(_FILE_FLAT, [])]
        in_env = [str(key) for key in data.pop(_ENV_FLAT, [])]
        in_code = _nest(data, flat_wins=True)
        try:
            settings = handler(data)
        except ValidationError as exc:
            raise _as_written(exc, {*in_file, *in_env, *in_code}) from None
        settings._flat_in_file = tuple(in_file)
        settings._flat_in_env = tuple(in_env)
        return settings

    @model_validator(mode="after")
    def _one_model_per_name(self) -> Settings:
        # Two entries of the file under one name would leave which one a line means to the
        # order they were seeded in; the file is refused instead, naming both.
        entries = [catalog_model_from(m) for m in self.catalog()]
        entries += [catalog_model_from(d, d.org) for d in self.deployments]
        for i, entry in enumerate(entries):
            clash = name_clash(entry, entries[:i])
            if clash is not None:
                name, holder = clash
                raise ValueError(
                    f"models: {name!r} names both {holder.id!r} and {entry.id!r} (as an id or "
                    "an alias); one name means one model"
                )
        return self

    def renamed_keys_notice(self) -> str | None:
        """One line naming the flat keys the file or the environment used and their new names
        (None: none was used). Keywords in code are not named: they are no one's to rename."""
        names = [f"{key} in the file is now {_new_name(key)}" for key in self._flat_in_file]
        names += [
            f"{_env_name(key)} is now {_env_name(_new_name(key))}" for key in self._flat_in_env
        ]
        if not names:
            return None
        return (
            "settings under names that go in the next release (docs/configuration.md): "
            + "; ".join(names)
        )

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
        # Each source moves its own flat keys into their sections, so that a flat key and a
        # nested one from different sources keep the sources' order of precedence.
        sources: list[PydanticBaseSettingsSource] = [init_settings, _FlatKeysInEnv(settings_cls)]
        if toml is not None:
            sources.append(_FlatKeysInFile(settings_cls, toml_file=toml))
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
