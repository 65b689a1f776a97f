"""What the CLI's commands share: reading settings, and a container opened for one task."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from backfill.adapters.blobs.master import MasterKeyError
from backfill.domain import audit
from backfill.domain.audit import ADMIN, CLI_ADDRESS, AuditScope
from backfill.errors import BackfillError
from backfill.settings import Settings

if TYPE_CHECKING:
    from backfill.container import Backfill


def load(config: Path | None, **overrides: Any) -> Settings:
    """Settings from ``config`` (TOML), the environment, and the overrides that are not None."""
    try:
        return Settings.from_file(config, **{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        # One line per bad setting, naming it and its bound, instead of a traceback.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        typer.secho(f"Error: invalid settings: {problems}", err=True, fg="red")
        raise typer.Exit(2) from None


@asynccontextmanager
async def opened(settings: Settings) -> AsyncIterator[Backfill]:
    """The API-side container on an up-to-date database, closed afterwards (no worker)."""
    from backfill.container import build

    backfill = build(settings, role="api")
    await backfill.init()
    try:
        yield backfill
    finally:
        await backfill.store.close()


@contextmanager
def operator_errors() -> Iterator[None]:
    """What the operator must fix (a master key, a refused admin input) ends the command with
    its message, not a traceback."""
    try:
        yield
    except (MasterKeyError, BackfillError) as exc:
        typer.secho(f"Error: {exc}", err=True, fg="red")
        raise typer.Exit(1) from None


ConfigOpt = Annotated[Path | None, typer.Option(help="TOML settings file.")]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print the JSON object the API answers, for scripts."),
]
DataOpt = Annotated[Path | None, typer.Option(help="Data directory of an embedded install.")]

Action = Callable[["Backfill"], Awaitable[str]]
T = TypeVar("T")


def to_json(data: Any) -> str:
    """What ``--json`` prints: the object the API answers, as it answers it, indented."""
    return json.dumps(data, indent=2)


def print_json(data: Any) -> None:
    typer.echo(to_json(data))


def admin_settings(config: Path | None, data: Path | None) -> Settings:
    return load(config, data_dir=data)


async def with_backfill(settings: Settings, action: Callable[[Backfill], Awaitable[T]]) -> T:
    async with opened(settings) as backfill:
        await backfill.seed_catalog()
        return await action(backfill)


def read_admin(settings: Settings, read: Callable[[Backfill], Awaitable[T]]) -> T:
    """What one admin ``read`` answers from the database, for the command to print."""
    with operator_errors():
        return asyncio.run(with_backfill(settings, read))


def run_admin(
    settings: Settings, action: Action, *, audited: tuple[str, str | None] | None = None
) -> None:
    """Run one admin ``action`` against the database and print what it answers. A command
    that changes something names its audit action and target in ``audited``: it is recorded
    as the admin API's actions are (docs/observability.md), from the address "cli"."""
    if audited is not None:
        action = _recorded(action, *audited)
    typer.echo(read_admin(settings, action))


def _recorded(action: Action, name: str, target: str | None) -> Action:
    async def run(backfill: Backfill) -> str:
        scope = AuditScope(
            at=time.time(), address=CLI_ADDRESS, action=name, actor=ADMIN, target=target
        )
        status, error = 200, None
        try:
            with audit.acting(scope):
                return await action(backfill)
        except BackfillError as exc:
            status, error = exc.status, exc.code
            raise
        except BaseException:
            status, error = 500, "server_error"
            raise
        finally:
            await backfill.services.audit.settle(scope, status, error)

    return run
