"""Webhooks signed per Standard Webhooks, sent through the SSRF-safe client (SPEC §10.4-5)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

from backfill.adapters.fetch.policy import FetchPolicy, Refused
from backfill.adapters.fetch.resolver import Lookup, system_lookup
from backfill.adapters.fetch.safe_client import SafeClient
from backfill.adapters.fetch.urls import shown
from backfill.ports import DeliveryFailed

# Names that are local by definition (RFC 6761, RFC 6762, RFC 8375, common private zones).
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".home.arpa", ".lan", ".intranet")


class SignedWebhooks:
    """The ``WebhookSender``: one POST per attempt, no redirect followed, answered or refused
    within ``timeout_s``."""

    def __init__(
        self,
        policy: FetchPolicy,
        *,
        lookup: Lookup = system_lookup,
    ) -> None:
        self._client = SafeClient(policy, lookup=lookup)
        self._timeout_s = policy.timeout_s

    def refusal(self, url: str) -> str | None:
        try:
            parsed = self._client.check(url)
        except Refused as exc:
            # The rule alone ("the URL is plain http"): the caller says what is wanted.
            return exc.reason.split(";", 1)[0]
        host = (parsed.raw_host or "").rstrip(".").lower()
        if (
            not self._client.policy.allow_private
            and ":" not in host
            and ("." not in host or host == "localhost" or host.endswith(_LOCAL_SUFFIXES))
        ):
            # Such names resolve to private addresses, which the connection would refuse
            # anyway: refused at creation instead of after the batch ends.
            return f"the host {host} is not a public name"
        return None

    async def deliver(self, url: str, message_id: str, body: bytes, secrets: Sequence[str]) -> int:
        # The timestamp is the attempt's, as the spec asks: receivers refuse stale ones.
        now = datetime.now(tz=UTC).replace(microsecond=0)
        text = body.decode()
        signatures = " ".join(Webhook(secret).sign(message_id, now, text) for secret in secrets)
        headers = {
            "webhook-id": message_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signatures,
            "User-Agent": "Backfill-Webhooks",
        }
        try:
            return await self._client.post_json(url, body, headers, self._timeout_s)
        except Refused as exc:
            raise DeliveryFailed(f"{shown(url)}: {exc.reason}") from None

    async def close(self) -> None:
        await self._client.close()
