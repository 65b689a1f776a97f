"""What the dashboard reads beyond the OpenAI objects: an org's credit and ledger entries,
its batches' charges, each org's credit, and the queue by model. Read models only; nothing
here changes money or work."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import Org
from backfill.domain.scheduling.demand import ModelDemand


class EntryKind(StrEnum):
    CREDIT = "credit"
    """Money an administrator added (``backfill admin credit``)."""
    BATCH = "batch"
    """What one catalog batch was charged so far, and what it still holds reserved."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One line of an org's ledger, newest first (a credit by its ``created_at``, a batch by
    when its row was written).

    ``amount`` is in picodollars: a credit's amount, or a batch's charges so far (positive;
    the API shows charges with a minus sign). ``reserved`` is what a running batch still holds
    back from the available balance; 0 once it ended.
    """

    id: str
    kind: EntryKind
    amount: int
    created_at: float
    note: str | None = None
    reserved: int = 0
    status: str | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class OrgCredit:
    """An org with its money as the ledger holds it now (picodollars)."""

    org: Org
    balance: int
    reserved: int

    @property
    def available(self) -> int:
        return self.balance - self.reserved


@dataclass(frozen=True, slots=True)
class OrgAccount:
    """An org's money as its own row and its credits hold it (picodollars), read without
    its receipts.

    ``balance = credits - charges`` holds exactly: a credit raises the balance in the
    transaction that records it, every charge (a token receipt, a span of GPU time) lowers it
    in the transaction that records that receipt, and neither record is ever removed. So the
    lifetime charges follow from the two.
    """

    org: Org
    credits: int
    """Every credit ever added."""
    balance: int
    reserved: int

    @property
    def charges(self) -> int:
        return self.credits - self.balance

    @property
    def available(self) -> int:
        return self.balance - self.reserved


@dataclass(frozen=True, slots=True)
class BatchCharges:
    """What one batch was charged so far and still holds reserved (picodollars)."""

    id: str
    status: BatchStatus
    billing: Billing
    charged: int
    reserved: int


@dataclass(frozen=True, slots=True)
class ModelQueue:
    """The unfinished batches of one model: how many, how many run, the lines not yet done,
    and the model's measured throughput (None until the planner has measured it)."""

    model: str
    batches: int
    in_progress: int
    remaining: int
    requests_per_s: float | None
    demand: ModelDemand | None = None
    """What the model's queue asks of its fleet (None: not read)."""
