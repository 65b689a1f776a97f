"""The notifier: sends what the outbox holds (SPEC §10.5, seed 004).

Messages are written in the transaction that ends a batch (adapters/db/outbox.py). Every worker
polls for due ones and leases each for one attempt, so in scale-out exactly one process sends an
attempt; one killed mid-attempt leaves the message due again when its lease ends, to be sent
with the same ``webhook-id``. Sends run as their own tasks, never inside the worker's loops.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import orjson
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from backfill.domain import ids
from backfill.domain.notifications import (
    MAX_ERROR_CHARS,
    Attempt,
    Channel,
    Notification,
    RetrySchedule,
    email_message,
    new_webhook_secret,
    secret_context,
)
from backfill.metrics import Metrics
from backfill.ports import (
    Clock,
    DeliveryFailed,
    Mailer,
    NotificationStore,
    Sealer,
    WebhookSender,
)
from backfill.runner.loops import end_within
from backfill.runner.spans import tracer

log = logging.getLogger("backfill.notify")


# How long a stopping worker lets the attempts under way finish before it gives them back.
STOP_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class NotifyConfig:
    webhooks: RetrySchedule
    emails: RetrySchedule
    # The longest one attempt may take, all of it (secrets, connection, every SMTP command):
    # it is cut off then. The lease is twice that and more, so it never runs out under a live
    # attempt and nobody sends the same attempt twice.
    attempt_timeout_s: float
    interval_s: float
    max_in_flight: int = 32
    public_url: str | None = None

    @property
    def lease_s(self) -> float:
        return 2 * self.attempt_timeout_s + 5


class Notifier:
    def __init__(
        self,
        store: NotificationStore,
        webhooks: WebhookSender,
        mailer: Mailer | None,
        sealer: Sealer,
        clock: Clock,
        config: NotifyConfig,
        metrics: Metrics,
    ) -> None:
        self._store = store
        self._webhooks = webhooks
        self._mailer = mailer
        self._sealer = sealer
        self._clock = clock
        self._config = config
        self._metrics = metrics
        # The attempts under way and the lease token each was claimed with.
        self._sending: dict[asyncio.Task[None], tuple[Notification, str]] = {}

    @property
    def interval_s(self) -> float:
        return self._config.interval_s

    async def step(self) -> bool:
        """Lease the due messages this sender has room for and start sending them; whether
        there was any (or no room)."""
        room = self._config.max_in_flight - len(self._sending)
        if room <= 0:
            return True
        now = self._clock.now()
        # A token per claim: the fence of each attempt is its own lease, not this sender's.
        token = ids.lease_token()
        claimed = await self._store.claim_notifications(
            now, token, now + self._config.lease_s, room
        )
        for message in claimed:
            task = asyncio.create_task(self._guarded(message, token), name=f"notify {message.id}")
            self._sending[task] = (message, token)
            task.add_done_callback(lambda done: self._sending.pop(done, None))
        return bool(claimed)

    async def stop(self) -> None:
        """Let the attempts under way finish for a moment; give back those that do not, as
        not made, so a restart sends them at once without spending an attempt."""
        if self._sending:
            # A copy: each attempt leaves ``_sending`` as it ends, cut short or not.
            sending = dict(self._sending)
            cut = [sending[task] for task in await end_within(sending, STOP_GRACE_S)]
            now = self._clock.now()
            for message, token in cut:
                try:
                    await self._store.give_back(message.id, token, now)
                except Exception:
                    log.warning(
                        "could not give back notification %s; it is retried when its lease ends",
                        message.id,
                    )
        await self._webhooks.close()

    def _schedule(self, message: Notification) -> RetrySchedule:
        return self._config.emails if message.channel == Channel.EMAIL else self._config.webhooks

    async def _guarded(self, message: Notification, token: str) -> None:
        try:
            # The receiver's address stays out of the span: a webhook URL may hold a token.
            with tracer.start_as_current_span(
                "notification.deliver", record_exception=False, set_status_on_exception=False
            ) as span:
                if span.is_recording():
                    span.set_attributes(
                        {
                            "backfill.batch_id": message.batch_id,
                            "backfill.notification_id": message.id,
                            "backfill.channel": message.channel.value,
                            "backfill.attempt": message.attempts,
                        }
                    )
                await self._attempt(message, token)
        except Exception:
            # The database failed while the attempt was recorded: its lease runs out and the
            # message is tried again.
            log.exception(
                "recording notification %s of batch %s failed", message.id, message.batch_id
            )

    async def _attempt(self, message: Notification, token: str) -> None:
        schedule = self._schedule(message)
        if message.attempts > schedule.attempts:
            # The last attempt was cut short (its sender died): that was the last one.
            await self._finish(message, token, schedule, None, "the last attempt was interrupted")
            return
        limit = self._config.attempt_timeout_s
        try:
            async with asyncio.timeout(limit):
                if message.channel == Channel.EMAIL:
                    await self._email(message)
                    status: int | None = None
                else:
                    status = await self._post(message)
        except TimeoutError:
            await self._finish(message, token, schedule, None, f"no answer within {limit:g} s")
            return
        except DeliveryFailed as exc:
            await self._finish(message, token, schedule, exc.status_code, exc.reason)
            return
        except Exception as exc:
            log.exception("notification %s of batch %s failed", message.id, message.batch_id)
            await self._finish(
                message, token, schedule, None, f"internal error ({type(exc).__name__})"
            )
            return
        if status is not None and not 200 <= status < 300:
            await self._finish(message, token, schedule, status, f"the receiver answered {status}")
            return
        await self._finish(message, token, schedule, status, None)

    async def _post(self, message: Notification) -> int:
        body = orjson.dumps(message.payload)
        signing = await self._secrets(message.org_id)
        return await self._webhooks.deliver(message.target, message.id, body, signing)

    async def _email(self, message: Notification) -> None:
        if self._mailer is None:
            raise DeliveryFailed("Backfill has no SMTP settings (smtp_host) to send email with")
        subject, text = email_message(message.payload, self._config.public_url)
        await self._mailer.send(message.target, subject, text)

    async def _secrets(self, org_id: str) -> list[str]:
        """The org's signing secrets: the current one, and those rotations replaced while
        they are within their grace; the org's first secret is made here when it has none."""
        stored = await self._store.webhook_secrets(org_id)
        context = secret_context(org_id)
        if stored.current is None:
            sealed = self._sealer.seal(new_webhook_secret().encode(), context)
            stored = await self._store.set_webhook_secret(
                org_id, sealed, int(self._clock.now()), rotate=False
            )
        assert stored.current is not None
        signing = [self._sealer.open(stored.current, context).decode()]
        for replaced in stored.signing_beside(self._clock.now()):
            signing.append(self._sealer.open(replaced.sealed, context).decode())
        return signing

    async def _finish(
        self,
        message: Notification,
        token: str,
        schedule: RetrySchedule,
        status: int | None,
        error: str | None,
    ) -> None:
        now = self._clock.now()
        delivered = error is None
        next_at = None if delivered else schedule.after(message.attempts, now)
        attempt = Attempt(
            delivered=delivered,
            at=int(now),
            status_code=status,
            error=None if error is None else error[:MAX_ERROR_CHARS],
            next_at=next_at,
        )
        outcome = "delivered" if delivered else ("retrying" if next_at is not None else "given_up")
        self._metrics.notifications.labels(message.channel.value, outcome).inc()
        if (span := trace.get_current_span()).is_recording():
            # The outcome, not the error's words: they may quote the receiver's answer.
            span.set_attribute("backfill.outcome", outcome)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if not delivered:
                span.set_status(StatusCode.ERROR, outcome)
        if not delivered:
            log.warning(
                "%s notification %s of batch %s, attempt %d: %s (%s)",
                message.channel.value,
                message.id,
                message.batch_id,
                message.attempts,
                error,
                "will retry" if next_at is not None else "given up",
            )
        if not await self._store.finish_attempt(message.id, token, attempt):
            log.warning("the lease of notification %s ran out before its attempt ended", message.id)
