"""``Store`` over SQLAlchemy Core: the one place with SQL.

The queries live in mixins by subject; ``SqlStore`` is all of them over one engine, and
``dialect.py`` holds what differs between SQLite and PostgreSQL.
"""

from __future__ import annotations

from backfill.adapters.db.accounts import AccountQueries
from backfill.adapters.db.audit import AuditQueries
from backfill.adapters.db.batch_controls import BatchControlQueries
from backfill.adapters.db.batches import BatchQueries
from backfill.adapters.db.claims import ClaimQueries
from backfill.adapters.db.demand import DemandQueries
from backfill.adapters.db.engine_configs import EngineConfigQueries
from backfill.adapters.db.engine_health import EngineHealthQueries
from backfill.adapters.db.estimates import EstimateQueries
from backfill.adapters.db.files import FileQueries
from backfill.adapters.db.finalizing import FinalizeQueries
from backfill.adapters.db.keyring import KeyringQueries
from backfill.adapters.db.notifications import NotificationQueries
from backfill.adapters.db.overview import OverviewQueries
from backfill.adapters.db.planning import PlanningQueries
from backfill.adapters.db.progress import ProgressQueries
from backfill.adapters.db.reruns import EndedBatchQueries
from backfill.adapters.db.result_pages import ResultPageQueries
from backfill.adapters.db.result_writes import ResultWriteQueries
from backfill.adapters.db.spend_caps import SpendCapQueries


class SqlStore(
    AccountQueries,
    AuditQueries,
    BatchControlQueries,
    # Before BatchQueries, which it builds on (admission's snapshot).
    EstimateQueries,
    BatchQueries,
    ClaimQueries,
    DemandQueries,
    EndedBatchQueries,
    EngineConfigQueries,
    EngineHealthQueries,
    FileQueries,
    FinalizeQueries,
    KeyringQueries,
    NotificationQueries,
    OverviewQueries,
    PlanningQueries,
    ProgressQueries,
    ResultWriteQueries,
    ResultPageQueries,
    SpendCapQueries,
):
    """A ``Store`` on SQLite (embedded) or PostgreSQL (scale-out)."""
