"""``backfill``: run the service, the simulator, admin tasks and whole batches."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
import uvicorn

from backfill.adapters.logs import JsonLines
from backfill.adapters.private import private_dir
from backfill.cli import admin, batch, estimate
from backfill.cli.banner import ready_banner, site
from backfill.cli.common import load, opened, operator_errors
from backfill.domain.money import usd_to_pico
from backfill.settings import Settings

if TYPE_CHECKING:
    from types import FrameType

    from backfill.adapters.http.worker_probe import WorkerProbe
    from backfill.container import Backfill

app = typer.Typer(
    help="Backfill: OpenAI-compatible batch inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(admin.app, name="admin")
app.add_typer(batch.app, name="batch")
# In a module of its own, built on batch.py's client and upload.
batch.app.command("estimate")(estimate.estimate)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _logging(level: str, log_format: Literal["text", "json"] = "text") -> None:
    """Log to stderr at ``level``, as text lines or as one JSON object a line."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # Migration chatter ("Context impl SQLiteImpl") is noise at every start.
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _note_renamed(settings: Settings) -> None:
    """Names the settings the file or the environment gave under their old flat names, once."""
    if notice := settings.renamed_keys_notice():
        logging.getLogger("backfill").warning("%s", notice)


def _lock(data_dir: Path) -> int:
    """One embedded process per data directory: it alone owns the queue's leases."""
    private_dir(data_dir)
    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        typer.echo(f"Another Backfill process is using {data_dir}; stop it first.", err=True)
        raise typer.Exit(1) from None
    return fd


async def _check(settings: Settings) -> None:
    """Open the database and check the master key before the server starts."""
    async with opened(settings):
        pass


async def _bootstrap(settings: Settings) -> str | None:
    async with opened(settings) as backfill:
        credit = usd_to_pico(settings.default_org_credit_usd)
        return await backfill.services.tenants.bootstrap(credit=credit)


class _Server(uvicorn.Server):
    """Calls ``on_ready`` once it accepts connections, the app's start-up (engines) done."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_soon = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # No await between here and the banner: it is printed before a request is served.
        if self.started and self._on_ready is not None:
            self._on_ready()

    async def main_loop(self) -> None:
        # uvicorn looks ten times a second whether to stop, and refreshes the Date header.
        # Here a signal ends the wait itself and each connection keeps the Date current
        # (GuardedHttpToolsProtocol), so the loop sleeps until a stop: every wake-up of an
        # idle server is CPU taken from an engine on the same cores (docs/performance.md).
        # A look a minute still catches a ``should_exit`` set without a signal.
        self._loop = asyncio.get_running_loop()
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_soon.wait(), 60.0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit_soon.set)


def _serve(settings: Settings, role: str, on_ready: Callable[[], None] | None = None) -> None:
    from backfill.adapters.http.server import server_config
    from backfill.adapters.tracing import install as install_tracing
    from backfill.container import build

    # A busy worker allocates many short-lived objects; with the default threshold the cyclic
    # collector ran for ~10% of its CPU (py-spy). Long-lived startup objects are frozen too.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)

    # Off unless [tracing] names a collector; the SDK and its exporter load only here.
    install_tracing(settings.tracing)
    backfill = build(settings, role=role)
    if role == "worker":
        if settings.worker.http_port is not None:
            _warn_open_metrics(settings)
        asyncio.run(_run_worker(backfill))
        return
    _warn_open_metrics(settings)
    _Server(server_config(backfill.app(), settings), on_ready).run()


def _warn_open_metrics(settings: Settings) -> None:
    if not settings.metrics_token and not _is_loopback(settings.host):
        logging.getLogger("backfill").warning(
            "/metrics is open to anyone who can reach %s; set metrics_token or block it at "
            "the proxy.",
            settings.host,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse_weak_admin_token(settings: Settings) -> None:
    problem = settings.admin_token_problem()
    if problem is not None:
        typer.echo(f"Cannot start: {problem}", err=True)
        raise typer.Exit(2)


async def _run_worker(backfill: Backfill) -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    probe = _worker_probe(backfill.settings, backfill.services.operations.render_metrics)
    # Listening before the start, so a port in use stops the process before it claims work,
    # and liveness answers while engines start (readiness says "starting" until then).
    if probe is not None:
        await probe.start()
    try:
        await backfill.start()
        if probe is not None:
            probe.mark_ready()
        try:
            await done.wait()
        finally:
            # Not ready while the worker drains, yet alive and scraped until it has stopped.
            if probe is not None:
                probe.mark_stopping()
            await backfill.stop()
    finally:
        if probe is not None:
            await probe.stop()


def _worker_probe(
    settings: Settings, render_metrics: Callable[[], Awaitable[bytes]]
) -> WorkerProbe | None:
    """The worker's /healthz, /readyz and /metrics where ``worker.http_port`` is set."""
    port = settings.worker.http_port
    if port is None:
        return None
    from backfill.adapters.http.auth import FailureBrake
    from backfill.adapters.http.worker_probe import WorkerProbe

    brake = None
    if settings.http.auth_failure_limit > 0:
        brake = FailureBrake(settings.http.auth_failure_limit, settings.http.auth_failure_window_s)
    return WorkerProbe(
        settings.host,
        port,
        render_metrics=render_metrics,
        metrics_token=settings.metrics_token,
        brake=brake,
    )


@app.command()
def up(
    # Unset flags leave the settings (file, then BACKFILL_* variables) to say, as for `serve`:
    # a container image sets BACKFILL_PORT once and every role, and its healthcheck, agree.
    port: Annotated[
        int | None, typer.Option(help="Port of the API (default: the settings', 8080).")
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(help="Address to listen on (default: the settings', 127.0.0.1)."),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help="Where the database and files live (default: the settings', backfill-data)."
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML settings file.")] = None,
    local_engine: Annotated[
        bool | None,
        typer.Option(
            help="Start the bundled llama.cpp engine (SmolLM2-135M); default: the settings', on."
        ),
    ] = None,
) -> None:
    """Embedded mode: API, scheduler and a local engine in one process, SQLite on disk."""
    settings = load(config, port=port, host=host, data_dir=data, local_engine=local_engine)
    _refuse_weak_admin_token(settings)
    _logging(settings.log_level, settings.log_format)
    _note_renamed(settings)
    _lock(settings.data_dir)
    with operator_errors():
        key = asyncio.run(_bootstrap(settings))
    root = site(settings.host, settings.port)
    if key:
        # Printed before serving too: a start killed while the engine loads must not lose it.
        typer.secho("Created organization 'default'. Its API key (shown once):", bold=True)
        typer.echo(f"\n    {key}\n")

    def ready() -> None:
        program = sys.argv[0] if Path(sys.argv[0]).name == "backfill" else "backfill"
        typer.echo(ready_banner(root=root, data_dir=settings.data_dir, key=key, program=program))

    engine = " and its local engine" if settings.local_engine else ""
    typer.echo(f"Starting Backfill{engine} at {root}/v1 (data in {settings.data_dir})...")
    with operator_errors():
        _serve(settings, "all", on_ready=ready)


@app.command()
def serve(
    role: Annotated[str, typer.Option(help="all, api or worker.")] = "all",
    config: Annotated[Path | None, typer.Option(help="TOML settings file.")] = None,
    port: Annotated[int | None, typer.Option(help="Port of the API.")] = None,
) -> None:
    """Run one scale-out role with the given configuration."""
    if role not in ("all", "api", "worker"):
        raise typer.BadParameter("role must be all, api or worker", param_hint="--role")
    settings = load(config, port=port)
    _refuse_weak_admin_token(settings)
    _logging(settings.log_level, settings.log_format)
    _note_renamed(settings)
    if role == "all" and settings.resolved_database_url.startswith("sqlite"):
        _lock(settings.data_dir)
    with operator_errors():
        asyncio.run(_check(settings))
        _serve(settings, role)


@app.command()
def simulate(
    port: Annotated[int, typer.Option()] = 9000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    ttft_ms: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Time to first token; with --slots, the latency before the engine's waiting "
            "queue (the API server's work). Default 50, or the --step-profile's.",
        ),
    ] = None,
    itl_ms: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Time per output token; with --slots, an engine step's base time. Default 1, "
            "or the --step-profile's.",
        ),
    ] = None,
    output_tokens: Annotated[int, typer.Option(min=0, help="Tokens per answer.")] = 64,
    max_concurrency: Annotated[
        int, typer.Option(min=0, help="0 = unlimited. Without --slots only.")
    ] = 0,
    error_rate: Annotated[float, typer.Option(help="Share of 500 answers.")] = 0.0,
    rate_limit_rate: Annotated[float, typer.Option(help="Share of 429 answers.")] = 0.0,
    drop_rate: Annotated[float, typer.Option(help="Share of dropped connections.")] = 0.0,
    seed: Annotated[int | None, typer.Option()] = None,
    slots: Annotated[
        int,
        typer.Option(
            min=0,
            help="Continuous batching as vLLM V1 schedules it, with this many sequence slots "
            "(vLLM's --max-num-seqs). 0 = each request timed alone.",
        ),
    ] = 0,
    prefill_ms_per_token: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Step time per uncached prompt token prefilled in the step. Default 0, or the "
            "--step-profile's.",
        ),
    ] = None,
    itl_growth: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Step slow-down with load: a step lasts itl_ms * (1 + itl_growth * max(0, "
            "scheduled - itl_knee) / slots) + prefill_ms_per_token * prefill tokens. Default 0, "
            "or the --step-profile's.",
        ),
    ] = None,
    itl_knee: Annotated[
        int,
        typer.Option(
            min=0,
            help="Sequences a step holds at --itl-ms: only those past it count in the slow-down "
            "(itl_growth * max(0, scheduled - itl_knee) / slots). At most --slots. Needs --slots.",
        ),
    ] = 0,
    step_profile: Annotated[
        Literal["flat", "steep"] | None,
        typer.Option(
            help="Presets of --ttft-ms, --itl-ms, --itl-growth, --prefill-ms-per-token (given "
            "flags win): flat (GPU-like decode) or steep (fitted to vLLM on 2 CPU cores). "
            "Needs --slots.",
        ),
    ] = None,
    max_num_batched_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            help="vLLM's --max-num-batched-tokens: tokens of one engine step (chunked "
            "prefill); at least --slots. Needs --slots.",
        ),
    ] = 2048,
    kv_capacity_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            help="KV cache size in tokens, in blocks of --block-tokens: a waiting request starts "
            "only when its blocks are free; a running one that cannot grow preempts.",
        ),
    ] = 262_144,
    block_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens per KV-cache block (vLLM: 16).")
    ] = 16,
    prefix_cache_blocks: Annotated[
        int,
        typer.Option(
            min=0, help="Prefix cache size in blocks, LRU; 0 = no prefix cache. Needs --slots."
        ),
    ] = 0,
    scheduling_policy: Annotated[
        Literal["fcfs", "priority"],
        typer.Option(
            help="vLLM's --scheduling-policy. fcfs accepts and ignores a request's 'priority'; "
            "priority (needs --slots) orders the waiting queue by it, lower values first, and "
            "picks the worst one running when KV blocks run out.",
        ),
    ] = "fcfs",
    model_name: Annotated[
        str, typer.Option(help="Served model name: /v1/models and the metrics' model_name.")
    ] = "simulated",
    embedding_dimensions: Annotated[
        int, typer.Option(min=1, help="Length of /v1/embeddings vectors (and most 'dimensions').")
    ] = 64,
) -> None:
    """A simulated OpenAI-compatible engine (no model) for load and fault tests."""
    from backfill.simulator.server import SimulatorConfig, run_simulator

    timing = {
        name: value
        for name, value in (
            ("ttft_ms", ttft_ms),
            ("itl_ms", itl_ms),
            ("itl_growth", itl_growth),
            ("prefill_ms_per_token", prefill_ms_per_token),
        )
        if value is not None
    }
    try:
        config = SimulatorConfig(
            **timing,
            output_tokens=output_tokens,
            max_concurrency=max_concurrency,
            error_rate=error_rate,
            rate_limit_rate=rate_limit_rate,
            drop_rate=drop_rate,
            seed=seed,
            slots=slots,
            kv_capacity_tokens=kv_capacity_tokens,
            block_tokens=block_tokens,
            prefix_cache_blocks=prefix_cache_blocks,
            scheduling_policy=scheduling_policy,
            max_num_batched_tokens=max_num_batched_tokens,
            itl_knee=itl_knee,
            step_profile=step_profile,
            model_name=model_name,
            embedding_dimensions=embedding_dimensions,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"Simulated engine (no model) on http://{host}:{port}/v1")
    run_simulator(config, host, port)


@db_app.command("upgrade")
def db_upgrade(
    config: Annotated[Path | None, typer.Option(help="TOML settings file.")] = None,
) -> None:
    """Apply every pending migration (also done at each start)."""
    from backfill.adapters.db.store import SqlStore

    settings = load(config)

    async def upgrade() -> None:
        store = SqlStore(settings.resolved_database_url)
        try:
            await store.init()
        finally:
            await store.close()

    asyncio.run(upgrade())
    typer.echo("The database schema is up to date.")


@db_app.command("revision")
def db_revision(
    message: Annotated[str, typer.Option("--message", "-m", help="What the migration does.")],
    config: Annotated[Path | None, typer.Option(help="TOML settings file.")] = None,
) -> None:
    """Write a new migration from the difference between the tables and the database."""
    from backfill.adapters.db.engine import SqlBase
    from backfill.adapters.db.migrate import revision

    settings = load(config)

    async def write() -> None:
        db = SqlBase(settings.resolved_database_url)
        try:
            await db.init()
            async with db.engine.begin() as conn:
                await conn.run_sync(revision, message)
        finally:
            await db.close()

    asyncio.run(write())


@db_app.command("reencrypt")
def db_reencrypt(
    config: Annotated[Path | None, typer.Option(help="TOML settings file.")] = None,
) -> None:
    """Rewrite stored content of the old format (not bound to its file), then refuse that
    format. Stop Backfill first."""
    from rich.console import Console

    from backfill.cli.reencrypt import reencrypt_all

    settings = load(config)
    if settings.resolved_database_url.startswith("sqlite"):
        _lock(settings.data_dir)
    with operator_errors():
        outcome = asyncio.run(reencrypt_all(settings, Console(stderr=True)))
    for file_id, why in outcome.failed.items():
        typer.echo(f"{file_id}: {why}", err=True)
    if outcome.failed:
        typer.echo(
            f"{len(outcome.failed)} of {outcome.files} files could not be re-encrypted; the old "
            "format stays accepted. Restore or delete those files and run this again.",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(
        f"Re-encrypted {outcome.rewritten} blobs of {outcome.files} files; "
        "content of the old format is refused from now on."
    )
