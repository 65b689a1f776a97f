"""``backfill admin webhook`` and ``backfill admin email``: an org's signing secret, its webhook
endpoints for batch events, and where its terminal-state emails go (docs/notifications.md).

With ``--json`` the read commands print the object the admin API answers for the same read
(``GET /admin/v1/orgs/{name}/webhook_secret``, ``.../webhooks``, ``.../notifications``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from backfill.cli.common import ConfigOpt, DataOpt, JsonOpt, admin_settings, run_admin, to_json
from backfill.domain.notifications import EVENTS

if TYPE_CHECKING:
    from backfill.container import Backfill

webhook_app = typer.Typer(
    help="Webhooks: an org's signing secret and its endpoints for batch events.",
    no_args_is_help=True,
)
email_app = typer.Typer(help="Where an org's batch emails go.", no_args_is_help=True)

OrgArg = Annotated[str, typer.Argument(help="Organization name.")]


@webhook_app.command("secret")
def webhook_secret(
    org: OrgArg,
    rotate: Annotated[
        bool,
        typer.Option(
            help="Make a new secret; each one replaced in the last 24 hours (the two last at "
            "most) keeps signing beside it, so receivers can switch over."
        ),
    ] = False,
    config: ConfigOpt = None,
    data: DataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the org's webhook signing secret (whsec_...), made on first use."""

    async def action(b: Backfill) -> str:
        from backfill.adapters.http.admin import secret_object

        signing = await b.services.notifications.signing_secret(org, rotate=rotate)
        return to_json(secret_object(org, signing)) if json_ else signing.secret

    # Showing the secret changes nothing; rotating it is an audited action.
    audited = ("webhook_secret.rotate", org) if rotate else None
    run_admin(admin_settings(config, data), action, audited=audited)


@webhook_app.command("add")
def webhook_add(
    org: OrgArg,
    url: Annotated[str, typer.Argument(help="An HTTPS URL on a public host.")],
    events: Annotated[
        str, typer.Option(help=f"Comma-separated, some of: {', '.join(sorted(EVENTS))}.")
    ] = ",".join(sorted(EVENTS)),
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Register an endpoint for batch events; prints it as JSON (the admin API's object)."""

    async def action(b: Backfill) -> str:
        from backfill.adapters.http.admin import endpoint_object

        wanted = [e.strip() for e in events.split(",") if e.strip()]
        endpoint = await b.services.notifications.add_endpoint(org, url, wanted)
        return to_json(endpoint_object(endpoint))

    run_admin(admin_settings(config, data), action, audited=("webhook.create", org))


@webhook_app.command("list")
def webhook_list(
    org: OrgArg, config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False
) -> None:
    """Print the org's endpoints: id, events and URL, one per line (--json: a list object)."""

    async def action(b: Backfill) -> str:
        from backfill.adapters.http.admin import endpoint_object
        from backfill.adapters.http.presenters import list_object

        endpoints = await b.services.notifications.endpoints(org)
        if json_:
            return to_json(list_object([endpoint_object(e) for e in endpoints], False))
        return (
            "\n".join(f"{e.id}  {','.join(sorted(e.events))}  {e.url}" for e in endpoints)
            or f"Organization {org} has no webhook endpoints."
        )

    run_admin(admin_settings(config, data), action)


@webhook_app.command("remove")
def webhook_remove(
    org: OrgArg,
    endpoint_id: Annotated[str, typer.Argument(help="The endpoint's id (we_...).")],
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Remove an endpoint; messages already queued for it are still sent."""

    async def action(b: Backfill) -> str:
        await b.services.notifications.remove_endpoint(org, endpoint_id)
        return f"Removed webhook endpoint {endpoint_id} of {org}."

    run_admin(admin_settings(config, data), action, audited=("webhook.delete", endpoint_id))


@email_app.command("set")
def email_set(
    org: OrgArg,
    address: Annotated[str, typer.Argument(help="Where the org's batch emails go.")],
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Send an email to ADDRESS whenever one of the org's batches ends (needs smtp_host)."""

    async def action(b: Backfill) -> str:
        await b.services.notifications.set_email(org, address)
        note = "" if b.settings.smtp.host else " Set smtp_host for Backfill to send them."
        return f"Batch emails of {org} go to {address}.{note}"

    run_admin(admin_settings(config, data), action, audited=("notification_email.set", org))


@email_app.command("off")
def email_off(org: OrgArg, config: ConfigOpt = None, data: DataOpt = None) -> None:
    """Send the org no more batch emails."""

    async def action(b: Backfill) -> str:
        await b.services.notifications.set_email(org, None)
        return f"Organization {org} gets no batch emails."

    run_admin(admin_settings(config, data), action, audited=("notification_email.set", org))


@email_app.command("show")
def email_show(
    org: OrgArg, config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False
) -> None:
    """Print where the org's batch emails go (--json: {"org", "email"}, email null when off)."""

    async def action(b: Backfill) -> str:
        address = await b.services.notifications.email(org)
        if json_:
            return to_json({"org": org, "email": address})
        return address or f"Organization {org} gets no batch emails."

    run_admin(admin_settings(config, data), action)
