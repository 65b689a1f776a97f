"""``backfill admin``: organizations and API keys, straight against the database."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer

from backfill.errors import BackfillError
from backfill.settings import Settings

app = typer.Typer(help="Administer organizations and keys.", no_args_is_help=True)
org_app = typer.Typer(help="Organizations.", no_args_is_help=True)
key_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(org_app, name="org")
app.add_typer(key_app, name="key")

ConfigOpt = Annotated[Path | None, typer.Option(help="TOML settings file.")]
DataOpt = Annotated[Path | None, typer.Option(help="Data directory of an embedded install.")]


def _settings(config: Path | None, data: Path | None) -> Settings:
    if config is not None:
        os.environ["BACKFILL_CONFIG"] = str(config)
    return Settings(data_dir=data) if data is not None else Settings()


async def _with_tenants(settings: Settings, action: str, *args: object) -> str:
    from backfill.container import build

    backfill = build(settings, role="api")
    await backfill.store.init()
    try:
        tenants = backfill.services.tenants
        if action == "org":
            org = await tenants.create_org(str(args[0]))
            return f"Created organization {org.name} ({org.id})."
        secret = await tenants.create_key(str(args[0]), frozenset(str(args[1]).split(",")))
        return secret
    finally:
        await backfill.store.close()


def _run(settings: Settings, action: str, *args: object) -> None:
    try:
        typer.echo(asyncio.run(_with_tenants(settings, action, *args)))
    except BackfillError as exc:
        typer.secho(exc.message, err=True, fg="red")
        raise typer.Exit(1) from None


@org_app.command("create")
def org_create(name: str, config: ConfigOpt = None, data: DataOpt = None) -> None:
    """Create an organization."""
    _run(_settings(config, data), "org", name)


@key_app.command("create")
def key_create(
    org: Annotated[str, typer.Option(help="Organization name.")],
    scopes: Annotated[
        str, typer.Option(help="Comma-separated: inference:write, requests:read.")
    ] = "inference:write,requests:read",
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Create an API key; prints only the key, which is shown this once."""
    _run(_settings(config, data), "key", org, scopes)
