"""``backfill admin``: organizations, API keys, credit, spend caps, catalog models, private
deployments, engines and the queue, straight against the database.

Every read command takes ``--json`` and then prints the object the admin API answers for the
same read (``GET /admin/v1/...``), so scripts see one shape wherever they read it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from backfill.cli.caps import spend_cap_app
from backfill.cli.common import (
    ConfigOpt,
    DataOpt,
    JsonOpt,
    admin_settings,
    print_json,
    read_admin,
    run_admin,
    to_json,
)
from backfill.cli.engines import engine_add, engine_remove, engine_set, engine_show
from backfill.cli.models import deployment_set, model_aliases, model_list, model_set
from backfill.cli.notify import email_app, webhook_app
from backfill.domain.audit import AuditEntry
from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.money import pico_to_usd
from backfill.domain.overview import ModelQueue
from backfill.domain.priority import DEFAULT_MAX_PRIORITY, MAX_PRIORITY
from backfill.domain.records import ApiKey, Org
from backfill.domain.scheduling.fair_share import MAX_WEIGHT, MIN_WEIGHT
from backfill.services.audit import entry_id
from backfill.settings import LOCAL_ENGINE, LOCAL_MODEL

if TYPE_CHECKING:
    from backfill.container import Backfill

app = typer.Typer(help="Administer organizations and keys.", no_args_is_help=True)
org_app = typer.Typer(help="Organizations.", no_args_is_help=True)
key_app = typer.Typer(help="API keys.", no_args_is_help=True)
credit_app = typer.Typer(help="Credit.", no_args_is_help=True)
model_app = typer.Typer(
    help="Catalog models, their batch prices and aliases.", no_args_is_help=True
)
deployment_app = typer.Typer(help="Private deployments (billed by GPU time).", no_args_is_help=True)
engine_app = typer.Typer(
    help="Engines: their health, and those stored for every worker (add, set, remove, show).",
    no_args_is_help=True,
)
engine_app.command("add")(engine_add)
engine_app.command("set")(engine_set)
engine_app.command("remove")(engine_remove)
engine_app.command("show")(engine_show)
model_app.command("list")(model_list)
model_app.command("set")(model_set)
model_app.command("aliases")(model_aliases)
deployment_app.command("set")(deployment_set)
app.add_typer(org_app, name="org")
app.add_typer(key_app, name="key")
app.add_typer(credit_app, name="credit")
app.add_typer(model_app, name="model")
app.add_typer(deployment_app, name="deployment")
app.add_typer(engine_app, name="engine")
app.add_typer(webhook_app, name="webhook")
app.add_typer(email_app, name="email")
app.add_typer(spend_cap_app, name="spend-cap")


@org_app.command("create")
def org_create(name: str, config: ConfigOpt = None, data: DataOpt = None) -> None:
    """Create an organization."""

    async def action(b: Backfill) -> str:
        org = await b.services.tenants.create_org(name)
        return f"Created organization {org.name} ({org.id})."

    run_admin(admin_settings(config, data), action, audited=("org.create", name))


def _org_json(org: Org) -> str:
    from backfill.adapters.http.admin import org_object

    return to_json(org_object(org))


@org_app.command("show")
def org_show(
    name: str, config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False
) -> None:
    """Print an organization as JSON (the admin API's object: its id, fair-share weight and
    priority cap);
    --json changes nothing here and is taken for scripts that pass it everywhere."""

    async def action(b: Backfill) -> str:
        return _org_json(await b.services.tenants.org(name))

    run_admin(admin_settings(config, data), action)


@org_app.command("set")
def org_set(
    name: str,
    weight: Annotated[
        int | None,
        typer.Option(
            help=f"Fair-share weight, {MIN_WEIGHT}..{MAX_WEIGHT}: its share of dispatch on "
            "shared engines relative to other orgs' (default 1)."
        ),
    ] = None,
    max_priority: Annotated[
        int | None,
        typer.Option(
            help=f"The highest priority its batches may be given, 0..{MAX_PRIORITY} "
            f"(default {DEFAULT_MAX_PRIORITY})."
        ),
    ] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Change an organization's weight, priority cap or both; prints it as JSON."""
    if weight is None and max_priority is None:
        raise typer.BadParameter("give --weight, --max-priority or both")

    changes = {"weight": weight, "max_priority": max_priority}

    async def action(b: Backfill) -> str:
        sent = {field: value for field, value in changes.items() if value is not None}
        return _org_json(await b.services.controls.update_org(name, sent))

    run_admin(admin_settings(config, data), action, audited=("org.update", name))


@org_app.command("ledger")
def org_ledger(
    name: str, config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False
) -> None:
    """Print an organization's ledger as JSON: amounts in picodollars, the receipt count and
    the balance in USD (--json: the admin API's ledger object, amounts in USD)."""

    async def action(b: Backfill) -> str:
        org = await b.services.tenants.org(name)
        ledger = await b.services.billing.ledger(org.id)
        if json_:
            from backfill.adapters.http.admin import ledger_object

            return to_json(ledger_object(name, ledger))
        return json.dumps(
            {
                "org": name,
                "credits": ledger.credits,
                "charges": ledger.charges,
                "balance": ledger.balance,
                "reserved": ledger.reserved,
                "available": ledger.available,
                "receipts": ledger.receipts,
                "balance_usd": pico_to_usd(ledger.balance),
            }
        )

    run_admin(admin_settings(config, data), action)


@key_app.command("create")
def key_create(
    org: Annotated[str, typer.Option(help="Organization name.")],
    scopes: Annotated[
        str, typer.Option(help="Comma-separated: inference:write, requests:read.")
    ] = "inference:write,requests:read",
    name: Annotated[str | None, typer.Option(help="A name to recognise the key by.")] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Create an API key; prints only the key, which is shown this once."""

    async def action(b: Backfill) -> str:
        made = await b.services.tenants.new_key(org, frozenset(scopes.split(",")), name)
        return made.secret

    run_admin(admin_settings(config, data), action, audited=("key.create", None))


def _when(ts: int | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(title: str, columns: tuple[str, ...]) -> Table:
    """A table whose cells fold onto more lines rather than being cut: ids print whole."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _keys_table(org: str, keys: list[ApiKey]) -> Table:
    table = _table(
        f"API keys of {org}", ("id", "name", "prefix", "scopes", "created", "last used", "revoked")
    )
    for k in keys:
        # Names are printable by construction, but markup in them must print as typed.
        table.add_row(
            k.id,
            Text(k.name or "-"),
            k.prefix,
            ",".join(sorted(k.scopes)),
            _when(k.created_at),
            _when(k.last_used_at),
            _when(k.revoked_at),
        )
    return table


@key_app.command("list")
def key_list(
    org: Annotated[str, typer.Option(help="Organization name.")],
    config: ConfigOpt = None,
    data: DataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List an organization's API keys (never the secrets), revoked ones included."""
    keys = read_admin(admin_settings(config, data), lambda b: b.services.tenants.keys(org))
    if json_:
        from backfill.adapters.http.admin import key_object
        from backfill.adapters.http.presenters import list_object

        print_json(list_object([key_object(k) for k in keys], False))
        return
    Console(width=200).print(_keys_table(org, keys))


@key_app.command("revoke")
def key_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (key_…), from 'key list'.")],
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Revoke an API key: every API process refuses it from its next request on."""

    async def action(b: Backfill) -> str:
        key = await b.services.tenants.revoke_key(key_id)
        return f"Revoked {key.id} ({key.prefix}…) at {_when(key.revoked_at)}."

    run_admin(admin_settings(config, data), action, audited=("key.revoke", key_id))


@credit_app.command("add")
def credit_add(
    org: Annotated[str, typer.Option(help="Organization name.")],
    usd: Annotated[str, typer.Option(help="Amount in USD, exact (e.g. 25 or 12.50).")],
    note: Annotated[str | None, typer.Option(help="Why, for the audit trail.")] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Add credit to an organization."""

    async def action(b: Backfill) -> str:
        ledger = await b.services.billing.credit(org, usd, note)
        return f"Added {usd} USD to {org}; balance {pico_to_usd(ledger.balance)} USD."

    run_admin(admin_settings(config, data), action, audited=("credit.add", org))


# What a probe found of the request priority Backfill sends (None: not probed, not known yet).
_PRIORITY = {"applied": "applied", "ignored": "IGNORED"}
_STATES = {
    EngineState.UP: "healthy",
    EngineState.DOWN: "DOWN",
    EngineState.STANDBY: "standby",
    EngineState.STARTING: "starting",
}


def _health_cell(report: EngineReport) -> str:
    """Its state, and for an engine started on demand how long its starts take."""
    state = _STATES[report.state]
    return state if report.start_s is None else f"{state} (starts in ~{report.start_s:.0f} s)"


def _engines_table(reports: list[EngineReport]) -> Table:
    table = _table(
        "Engines, as each live worker sees them",
        (
            "engine",
            "health",
            "since",
            "last error",
            "in flight",
            "limit",
            "priority",
            "worker",
            "url",
        ),
    )
    for r in reports:
        table.add_row(
            r.engine,
            _health_cell(r),
            _when(int(r.since)),
            Text(r.last_error or "-"),
            str(r.in_flight),
            f"{r.concurrency_limit} of {r.max_concurrency}",
            _PRIORITY.get(r.priority or "", "-"),
            r.worker,
            r.url or "-",
        )
    return table


def _configured(config: Path | None, data: Path | None) -> str:
    settings = admin_settings(config, data)
    stored = read_admin(settings, lambda b: b.services.engines.all())
    names = [f"{e.name} ({e.spec.get('base_url', '')})" for e in stored]
    # The file's, until a worker's start stores them.
    known = {e.name for e in stored}
    names += [
        f"{e.name} ({'managed' if e.command else e.base_url})"
        for e in settings.engines
        if e.name not in known
    ]
    if settings.local_engine:
        names.insert(0, f"{LOCAL_ENGINE} (managed llama.cpp serving {LOCAL_MODEL})")
    return ", ".join(names) or "none"


@engine_app.command("list")
def engine_list(config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False) -> None:
    """Show each engine as the running workers see it: health, since when, the last error,
    requests in flight and the limit (the same as GET /admin/v1/engines)."""
    reports = read_admin(admin_settings(config, data), lambda b: b.services.operations.engines())
    if json_:
        from backfill.adapters.http.admin import engine_object
        from backfill.adapters.http.presenters import list_object

        print_json(list_object([engine_object(r) for r in reports], False))
        return
    if not reports:
        typer.echo(
            "No running worker reports engines (workers report every lease_s / 3; is one "
            f"running?). Engines this configuration defines: {_configured(config, data)}."
        )
        return
    Console(width=200).print(_engines_table(reports))


def _queue_table(found: list[ModelQueue]) -> Table:
    margin = next((q.demand.deadline_margin_fraction for q in found if q.demand), 0.0)
    table = _table(
        f"Unfinished batches by model, and the replicas their deadlines need "
        f"(margin {margin:g} of each window)",
        (
            "model",
            "batches",
            "requests left",
            "queued",
            "tokens (bound)",
            "replicas up",
            "req/s per replica",
            "replicas needed",
        ),
    )
    for q in found:
        d = q.demand
        per_replica = "-" if d is None or d.per_replica_rps is None else f"{d.per_replica_rps:.2f}"
        table.add_row(
            q.model,
            str(q.batches),
            str(q.remaining),
            "-" if d is None else str(d.queued_requests),
            "-" if d is None else str(d.queued_tokens_bound),
            "-" if d is None else str(d.replicas),
            per_replica,
            "-" if d is None else str(d.replicas_needed),
        )
    return table


@app.command("queue")
def queue(config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False) -> None:
    """Show each model with unfinished batches: the requests and tokens queued, the replicas
    up, the rate one replica serves, and the replicas that finish every accepted batch before
    its deadline (the same as GET /admin/v1/queue)."""
    found = read_admin(admin_settings(config, data), lambda b: b.services.fleet.queue())
    if json_:
        from backfill.adapters.http.admin_views import queue_list

        print_json(queue_list(found))
        return
    if not found:
        typer.echo("The queue is empty: no model has unfinished batches.")
        return
    Console(width=200).print(_queue_table(found))


@app.command("audit")
def audit_log(
    org: Annotated[str | None, typer.Option(help="Only the actions of this org's keys.")] = None,
    action: Annotated[
        str | None, typer.Option(help="Only this action, e.g. batch.cancel or key.create.")
    ] = None,
    actor: Annotated[str | None, typer.Option(help="Only this actor: admin or a key id.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="Entries to print.")] = 20,
    after: Annotated[
        str | None, typer.Option(help="Older than this entry id (the last one printed).")
    ] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the audit log, newest first: who changed what, when, from where, and how it
    ended (--json: the admin API's list object, GET /admin/v1/audit)."""
    page = read_admin(
        admin_settings(config, data),
        lambda b: b.services.audit.page(
            after=after, limit=limit, org=org, action=action, actor=actor
        ),
    )
    if json_:
        from backfill.adapters.http.admin import audit_object
        from backfill.adapters.http.presenters import list_object

        print_json(list_object([audit_object(e) for e in page.entries], page.has_more))
        return
    Console(width=200).print(_audit_table(page.entries, page.has_more))


def _audit_table(entries: list[AuditEntry], has_more: bool) -> Table:
    table = Table(
        title="Audit log, newest first",
        caption="More with --after " + entry_id(entries[-1]) if has_more and entries else None,
    )
    for column in ("id", "when (UTC)", "actor", "action", "target", "from", "outcome"):
        table.add_column(column)
    for entry in entries:
        outcome = Text(entry.outcome.value, style="green" if entry.status < 400 else "red")
        if entry.status >= 400:
            outcome.append(f" {entry.status} {entry.error or ''}".rstrip())
        table.add_row(
            entry_id(entry),
            datetime.fromtimestamp(entry.at, UTC).strftime("%Y-%m-%d %H:%M:%S"),
            entry.actor,
            entry.action,
            entry.target or "",
            entry.address or "",
            outcome,
        )
    return table
