"""The janitor: deletes expired content and marks its files ``deleted`` (SPEC §10.3)."""

from __future__ import annotations

import logging

from backfill.domain import ids
from backfill.ports import AuditStore, Clock, NotificationStore, OperationsStore
from backfill.services.files import FileService

log = logging.getLogger("backfill.retention")

# The singleton lease that lets one process at a time sweep for everyone.
JANITOR = "janitor"


class Janitor:
    def __init__(
        self,
        store: OperationsStore,
        files: FileService,
        clock: Clock,
        lease_s: float = 120.0,
        *,
        notifications: NotificationStore | None = None,
        keep_notifications_s: int = 7 * 24 * 3600,
        audit: AuditStore | None = None,
        keep_audit_s: int = 400 * 86_400,
    ) -> None:
        self._store = store
        self._files = files
        self._clock = clock
        self._lease_s = lease_s
        # Settled notifications are kept this long (as long as results), then pruned.
        self._notifications = notifications
        self._keep_notifications_s = keep_notifications_s
        # The audit log is kept for its own setting (audit.retention_days), then pruned.
        self._audit = audit
        self._keep_audit_s = keep_audit_s
        self.holder = ids.lease_token()

    async def sweep(self, batch_size: int = 200) -> int:
        """Remove every expired file; returns how many were removed (0 while another process
        holds the janitor's lease)."""
        removed = 0
        while True:
            # Taken before every page: that renews the lease through a long sweep, and every
            # worker may call this without all of them deleting the same files.
            now = self._clock.now()
            if not await self._store.take_singleton(JANITOR, self.holder, now + self._lease_s, now):
                break
            expired = await self._files.expired(int(now), batch_size)
            for record in expired:
                await self._files.remove(record)
            removed += len(expired)
            if len(expired) < batch_size:
                break
        if removed:
            log.info("janitor removed %d expired files", removed)
        if self._notifications is not None and await self._store.take_singleton(
            JANITOR, self.holder, self._clock.now() + self._lease_s, self._clock.now()
        ):
            cut = int(self._clock.now()) - self._keep_notifications_s
            await self._notifications.prune_notifications(cut)
        if self._audit is not None and await self._store.take_singleton(
            JANITOR, self.holder, self._clock.now() + self._lease_s, self._clock.now()
        ):
            pruned = await self._audit.prune_audit(self._clock.now() - self._keep_audit_s)
            if pruned:
                log.info("janitor removed %d audit entries past audit.retention_days", pruned)
        return removed
