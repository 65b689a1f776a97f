"""``POST /v1/batches/estimate``: what creating a batch would cost, whether it would be accepted,
and when it would finish, with nothing stored and nothing reserved (docs/api.md, "Estimating a
batch")."""

from __future__ import annotations

from typing import Protocol

from backfill.domain import estimates
from backfill.domain.admission import AdmissionSnapshot, check, check_worst_case
from backfill.domain.batch_request import CreateBatchRequest
from backfill.domain.estimates import AnswerSample, Estimate
from backfill.domain.records import Admission, BatchRecord
from backfill.errors import BackfillError
from backfill.ports import Clock
from backfill.services.batches import BatchService
from backfill.services.files import FileService


class EstimateStore(Protocol):
    async def admission_snapshot(
        self, batch: BatchRecord, admission: Admission
    ) -> AdmissionSnapshot:
        """What creating ``batch`` would read to admit it, read now without writing; the
        model's backlog included."""
        ...

    async def answer_sample(self, org_id: str, model: str) -> AnswerSample:
        """The org's recent successful answers of ``model``, counted with their output
        tokens."""
        ...


class EstimateService:
    def __init__(
        self, store: EstimateStore, batches: BatchService, files: FileService, clock: Clock
    ) -> None:
        self._store = store
        self._batches = batches
        self._files = files
        self._clock = clock

    async def estimate(
        self, org_id: str, request: CreateBatchRequest, api_key_id: str | None = None
    ) -> Estimate:
        """What ``BatchService.create`` would decide for ``request`` now. A fault of the request
        itself (an unknown file, a window out of range) is raised as creation raises it; a
        refusal of admission (credit, spend caps, limits, capacity) is part of the answer."""
        # The same batch, reservation and terms creation builds, by the same code.
        batch, admission = await self._batches.proposal(org_id, request, api_key_id)
        file = await self._files.get(org_id, batch.input_file_id, param="input_file_id")
        snapshot = await self._store.admission_snapshot(batch, admission)
        refusal: BackfillError | None = None
        try:
            # The checks the store makes when it creates the batch, in its order.
            check_worst_case(admission.reserve)
            check(snapshot, batch, admission)
        except BackfillError as exc:
            refusal = exc
        sample = await self._store.answer_sample(org_id, batch.model)
        return Estimate(
            batch=batch,
            prompt_token_bound=file.prompt_token_bound,
            reserve=admission.reserve,
            expected=estimates.expected(
                batch.prices,
                file.prompt_token_bound,
                file.max_output_tokens,
                batch.total,
                sample,
            ),
            refusal=refusal,
            available=snapshot.available,
            completion_at=estimates.completion_at(
                self._clock.now(),
                batch.total,
                snapshot.unfinished_lines,
                snapshot.measured_rps,
                snapshot.start_delay_s,
            ),
        )
