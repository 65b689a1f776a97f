"""Notification settings of an org (signing secret, webhook endpoints, email address) and the
delivery log of a batch's notifications (SPEC §10.5, docs/notifications.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backfill.domain import ids
from backfill.domain.notifications import (
    EVENTS,
    MAX_ENDPOINTS_PER_ORG,
    PREVIOUS_SECRET_GRACE_S,
    Endpoint,
    Notification,
    new_webhook_secret,
    notify_address,
    secret_context,
)
from backfill.errors import Conflict, InvalidInput, NotFound
from backfill.ports import BatchStore, Clock, NotificationStore, Sealer, TenantStore
from backfill.services.tenants import find_org


@dataclass(frozen=True, slots=True)
class SigningSecret:
    secret: str
    # Until when the one it replaced signs beside it (Unix seconds; an older secret replaced
    # within the grace stops before that); None: only this one signs.
    previous_valid_until: int | None


class NotificationService:
    def __init__(
        self,
        store: NotificationStore,
        tenants: TenantStore,
        batches: BatchStore,
        sealer: Sealer,
        clock: Clock,
        webhook_refusal: Callable[[str], str | None],
    ) -> None:
        self._store = store
        self._tenants = tenants
        self._batches = batches
        self._sealer = sealer
        self._clock = clock
        self._refusal = webhook_refusal

    async def deliveries(self, org_id: str, batch_id: str) -> list[Notification]:
        """The notifications of one of the org's batches and where each delivery stands."""
        if not ids.plausible(batch_id) or await self._batches.get_batch(org_id, batch_id) is None:
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        return await self._store.batch_notifications(org_id, batch_id)

    async def signing_secret(self, org_name: str, *, rotate: bool = False) -> SigningSecret:
        """The org's webhook signing secret (made on first use); ``rotate`` replaces it, and
        each replaced one keeps signing beside it for a day so receivers can switch over."""
        org = await find_org(self._tenants, org_name)
        context = secret_context(org.id)
        now = int(self._clock.now())
        stored = await self._store.webhook_secrets(org.id)
        if rotate or stored.current is None:
            sealed = self._sealer.seal(new_webhook_secret().encode(), context)
            stored = await self._store.set_webhook_secret(org.id, sealed, now, rotate=rotate)
        assert stored.current is not None
        beside = stored.signing_beside(now)
        until = max(r.replaced_at for r in beside) + PREVIOUS_SECRET_GRACE_S if beside else None
        return SigningSecret(self._sealer.open(stored.current, context).decode(), until)

    async def add_endpoint(self, org_name: str, url: object, events: object) -> Endpoint:
        org = await find_org(self._tenants, org_name)
        if not isinstance(url, str) or not url:
            raise InvalidInput("'url' must be an HTTPS URL on a public host.", param="url")
        reason = self._refusal(url)
        if reason is not None:
            raise InvalidInput(
                f"'url' must be an HTTPS URL on a public host: {reason}.", param="url"
            )
        wanted = _events(events)
        endpoint = Endpoint(ids.webhook_endpoint_id(), url, wanted)
        if not await self._store.add_webhook_endpoint(
            org.id, endpoint, int(self._clock.now()), MAX_ENDPOINTS_PER_ORG
        ):
            raise Conflict(
                f"Organization {org.name} already has {MAX_ENDPOINTS_PER_ORG} webhook "
                "endpoints; remove one first.",
                code="too_many_endpoints",
            )
        return endpoint

    async def endpoints(self, org_name: str) -> list[Endpoint]:
        org = await find_org(self._tenants, org_name)
        return await self._store.webhook_endpoints(org.id)

    async def remove_endpoint(self, org_name: str, endpoint_id: str) -> None:
        org = await find_org(self._tenants, org_name)
        if not ids.plausible(endpoint_id) or not await self._store.remove_webhook_endpoint(
            org.id, endpoint_id
        ):
            raise NotFound(
                f"Organization {org.name} has no webhook endpoint {endpoint_id!r}.",
                param="endpoint_id",
            )

    async def set_email(self, org_name: str, email: object) -> str | None:
        """Where the org's terminal-state emails go; None stops them."""
        org = await find_org(self._tenants, org_name)
        address = notify_address(email)
        await self._store.set_notify_email(org.id, address)
        return address

    async def email(self, org_name: str) -> str | None:
        org = await find_org(self._tenants, org_name)
        return await self._store.notify_email(org.id)


def _events(events: object) -> frozenset[str]:
    names = sorted(EVENTS)
    if (
        not isinstance(events, Sequence)
        or isinstance(events, str)
        or not events
        or not all(isinstance(e, str) for e in events)
    ):
        raise InvalidInput(
            f"'events' must be a non-empty list of event types from {names}.", param="events"
        )
    unknown = sorted({str(e) for e in events} - EVENTS)
    if unknown:
        raise InvalidInput(
            f"'events' has unknown event types {unknown}; use some of {names}.", param="events"
        )
    return frozenset(str(e) for e in events)
