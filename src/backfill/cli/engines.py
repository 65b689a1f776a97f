"""``backfill admin engine add|set|remove|show``: engines stored for every worker, managed at
run time (docs/fleet.md). Each prints the engine as ``GET /admin/v1/engines/{name}`` does."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from backfill.cli.common import ConfigOpt, DataOpt, JsonOpt, admin_settings, run_admin, to_json

if TYPE_CHECKING:
    from backfill.container import Backfill

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="An engine setting (as in the config file's engines) as KEY=VALUE, the value as "
        "JSON where it parses (max_concurrency=32, mode=shared, priority=10, "
        'models=\'["a","b"]\'); repeatable.',
    ),
]
ApiKeyEnvOpt = Annotated[
    str | None,
    typer.Option(
        help="The name of an environment variable holding the engine's API key (kept off the "
        "command line); it is stored sealed and never shown."
    ),
]


def _settings(pairs: list[str] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: write KEY=VALUE, e.g. max_concurrency=32")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return fields


def _api_key(variable: str | None) -> dict[str, Any]:
    if variable is None:
        return {}
    value = os.environ.get(variable)
    if not value:
        raise typer.BadParameter(
            f"the environment variable {variable} is not set", param_hint="--api-key-env"
        )
    return {"api_key": value}


def _printed(b: Backfill, engine: Any) -> str:
    from backfill.adapters.http.admin import stored_engine_object

    return to_json(stored_engine_object(b.services.engines, engine))


def engine_add(
    name: Annotated[str, typer.Argument(help="The engine's name, e.g. vllm-a.")],
    base_url: Annotated[str, typer.Option(help="e.g. http://10.0.0.5:8000/v1")],
    model: Annotated[list[str], typer.Option(help="A catalog model it serves; repeatable.")],
    settings: SetOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    disabled: Annotated[bool, typer.Option(help="Store it without serving it yet.")] = False,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Store an engine for every worker to serve within seconds, no restart."""
    fields = {"name": name, "base_url": base_url, "models": model, **_settings(settings)}
    fields |= _api_key(api_key_env)
    if disabled:
        fields["enabled"] = False

    async def action(b: Backfill) -> str:
        return _printed(b, await b.services.engines.add(fields))

    run_admin(admin_settings(config, data), action, audited=("engine.create", name))


def engine_set(
    name: Annotated[str, typer.Argument()],
    settings: SetOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    no_api_key: Annotated[bool, typer.Option(help="Remove its API key.")] = False,
    enable: Annotated[
        bool | None, typer.Option("--enable/--disable", help="Serve it, or drain it.")
    ] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Change a stored engine; every worker applies it at once (new requests follow it,
    requests running finish as they started)."""
    fields = _settings(settings) | _api_key(api_key_env)
    if no_api_key:
        fields["api_key"] = None
    if enable is not None:
        fields["enabled"] = enable

    async def action(b: Backfill) -> str:
        return _printed(b, await b.services.engines.change(name, fields))

    run_admin(admin_settings(config, data), action, audited=("engine.update", name))


def engine_remove(
    name: Annotated[str, typer.Argument()], config: ConfigOpt = None, data: DataOpt = None
) -> None:
    """Remove a stored engine: every worker drains it (no new work; what runs finishes)."""

    async def action(b: Backfill) -> str:
        await b.services.engines.remove(name)
        return f"Removed engine {name}: workers take no new work to it and let it go."

    run_admin(admin_settings(config, data), action, audited=("engine.delete", name))


def engine_show(
    name: Annotated[str | None, typer.Argument(help="One engine; all when left out.")] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the stored engines' settings (never their API keys)."""

    async def action(b: Backfill) -> str:
        from backfill.adapters.http.admin import stored_engine_object
        from backfill.adapters.http.presenters import list_object

        admin = b.services.engines
        if name is not None:
            return _printed(b, await admin.get(name))
        engines = [stored_engine_object(admin, e) for e in await admin.all()]
        if json_:
            return to_json(list_object(engines, False))
        lines = [
            f"{e['id']}  {'enabled' if e['enabled'] else 'disabled'}  {e['source']}  "
            f"{e['base_url']}  {','.join(e['models'])}  max_concurrency={e['max_concurrency']} "
            f"mode={e['mode']} discovery={e['discovery']}"
            for e in engines
        ]
        return "\n".join(lines) or "No engine is stored."

    run_admin(admin_settings(config, data), action)
