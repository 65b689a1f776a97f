"""Failures inside the worker's own request path (SPEC §9.6, §7.3): a database error on the way
to the engine gives the engine slot and the lease back; engine-reported usage cannot overflow a
column or credit an org; a request that keeps failing inside Backfill ends as an error row
instead of being retried until its window ends.
"""

from __future__ import annotations

from pathlib import Path

from backfill.adapters.clock import SystemClock
from backfill.domain.catalog import CatalogModel
from backfill.errors import StorageError
from backfill.ports import Catalog
from tests.integration.test_gpu_time import (
    DEPLOYMENT,
    created,
    fleet,
    private_line,
    wait_terminal,
)


class CatalogFailingOnce:
    """The real catalog, whose next read fails as a lost database connection would."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self.failures_left = 1

    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        if self.failures_left:
            self.failures_left -= 1
            raise StorageError("The database failed while reading the catalog: OSError.")
        return await self._catalog.find(name, org_id)

    async def all(self, org_id: str | None = None) -> list[CatalogModel]:
        return await self._catalog.all(org_id)


async def test_catalog_read_failing_before_a_gpu_time_request_releases_its_slot(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, clock=SystemClock(), private_concurrency=1) as f:
        worker = f.bf.backfill.worker
        assert worker is not None
        failing = CatalogFailingOnce(worker._catalog)
        worker._catalog = failing
        rows = [private_line(f"g{i}", f"gpu {i}") for i in range(3)]
        batch = await created(f.bf, rows)

        done = await wait_terminal(f.bf, batch["id"])
        assert failing.failures_left == 0, "the catalog read never failed"
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        # With one slot, a leaked slot would have left nothing to run the batch on.
        [private] = [s for s in worker._pool.slots if s.engine.serves(DEPLOYMENT)]
        assert private.in_flight == 0
