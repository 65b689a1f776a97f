"""``backfill admin spend-cap``: caps on what an org, or one of its API keys, may spend in a
day, week or month (UTC) or in all (docs/billing.md, "Spend caps"), as ``/admin/v1`` sets them.

``set`` prints the cap as the admin API answers it; ``list --json`` prints the list object of
``GET /admin/v1/orgs/{name}/spend_caps``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

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
from backfill.domain.money import pico_to_usd
from backfill.domain.spend_caps import CapScope, CapUse, Period, iso

if TYPE_CHECKING:
    from backfill.container import Backfill

spend_cap_app = typer.Typer(
    help="Spend caps: the most an org or an API key may spend in a day, week, month or in all.",
    no_args_is_help=True,
)

_PERIODS = ", ".join(p.value for p in Period)
OrgOpt = Annotated[str | None, typer.Option(help="Cap this organization (by name).")]
KeyOpt = Annotated[str | None, typer.Option(help="Cap this API key (its id, key_…).")]
PeriodOpt = Annotated[
    str,
    typer.Option(
        help=f"The window: {_PERIODS}. Days, ISO weeks (from Monday) and months are UTC "
        "calendar ones; total is all time."
    ),
]


def _one_of(org: str | None, key: str | None) -> tuple[str | None, str | None]:
    if (org is None) == (key is None):
        raise typer.BadParameter("give either --org NAME or --key KEY_ID")
    return org, key


@spend_cap_app.command("set")
def cap_set(
    period: PeriodOpt,
    usd: Annotated[str, typer.Option(help="The cap in USD, exact (e.g. 100 or 12.50); 0 stops.")],
    org: OrgOpt = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Set (or replace) a cap of an org or a key; prints it as JSON with its current window."""
    org, key = _one_of(org, key)

    async def action(b: Backfill) -> str:
        from backfill.adapters.http.presenters import spend_cap_object

        caps = b.services.spend_caps
        use = (
            await caps.set_org_cap(org, period, usd)
            if org is not None
            else await caps.set_key_cap(key or "", period, usd)
        )
        return to_json(spend_cap_object(use))

    run_admin(admin_settings(config, data), action, audited=("spend_cap.set", org or key))


@spend_cap_app.command("remove")
def cap_remove(
    period: PeriodOpt,
    org: OrgOpt = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Remove a cap of an org or a key: batches are no longer refused for it."""
    org, key = _one_of(org, key)

    async def action(b: Backfill) -> str:
        caps = b.services.spend_caps
        if org is not None:
            await caps.remove_org_cap(org, period)
            return f"Removed the {period} spend cap of organization {org}."
        await caps.remove_key_cap(key or "", period)
        return f"Removed the {period} spend cap of API key {key}."

    run_admin(admin_settings(config, data), action, audited=("spend_cap.delete", org or key))


def _caps_table(org: str, uses: list[CapUse]) -> Table:
    table = Table(title=f"Spend caps of {org} and its keys (USD; windows in UTC)")
    for column in ("cap of", "period", "limit", "charged", "reserved", "left", "resets at"):
        table.add_column(column, overflow="fold")
    for use in uses:
        cap = use.cap
        table.add_row(
            "the org" if cap.scope == CapScope.ORG else cap.scope_id,
            cap.period.value,
            pico_to_usd(cap.limit),
            pico_to_usd(use.charged),
            pico_to_usd(use.reserved),
            pico_to_usd(use.left),
            "never" if use.window.resets_at is None else iso(use.window.resets_at),
        )
    return table


@spend_cap_app.command("list")
def cap_list(
    org: Annotated[str, typer.Argument(help="Organization name.")],
    config: ConfigOpt = None,
    data: DataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show the org's caps and its keys', with what each current window was charged, still
    holds reserved, and has left."""

    uses = read_admin(admin_settings(config, data), lambda b: b.services.spend_caps.org_caps(org))
    if json_:
        from backfill.adapters.http.presenters import list_object, spend_cap_object

        print_json(list_object([spend_cap_object(u) for u in uses], False))
        return
    if not uses:
        typer.echo(f"Organization {org} and its keys have no spend caps.")
        return
    Console(width=200).print(_caps_table(org, uses))
