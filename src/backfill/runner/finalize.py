"""Build a batch's output and error files from stored results and publish them (SPEC §9.7)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

from backfill.domain.results import ERROR_MESSAGES, error_row
from backfill.ports import BatchRecord, BlobStore, Clock, FileRecord, Sealer, Store
from backfill.services.files import OUTPUT_PURPOSE, content_key

_FLUSH_BYTES = 1024 * 1024


def result_file_id(batch_id: str, kind: str) -> str:
    """Deterministic, so a finalize that is redone after a crash rewrites the same blobs."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def result_context(batch_id: str, idx: int) -> bytes:
    return f"{batch_id}/{idx}".encode()


class Finalizer:
    def __init__(
        self, store: Store, blobs: BlobStore, sealer: Sealer, clock: Clock, output_ttl_s: int
    ) -> None:
        self._store = store
        self._blobs = blobs
        self._sealer = sealer
        self._clock = clock
        self._output_ttl_s = output_ttl_s

    async def finalize(
        self,
        batch: BatchRecord,
        expected: str,
        terminal: str,
        *,
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        if before is not None:
            await before()
        out_id = result_file_id(batch.id, "output")
        err_id = result_file_id(batch.id, "error")
        out = await self._blobs.writer(content_key(out_id))
        err = await self._blobs.writer(content_key(err_id))
        buffers = {True: bytearray(), False: bytearray()}
        writers = {True: out, False: err}
        try:
            async for page in self._store.iter_results(batch.id):
                for r in page:
                    if r.payload is not None:
                        row = self._sealer.open(r.payload, result_context(batch.id, r.idx))
                    else:
                        code = r.error_code or "engine_unavailable"
                        row = error_row(r.custom_id, code, ERROR_MESSAGES.get(code, code))
                    buf = buffers[r.ok]
                    buf += row
                    buf += b"\n"
                    if len(buf) >= _FLUSH_BYTES:
                        await writers[r.ok].write(bytes(buf))
                        buf.clear()
            for ok, buf in buffers.items():
                if buf:
                    await writers[ok].write(bytes(buf))
            out_size = await out.commit()
            err_size = await err.commit()
        except BaseException:
            await out.abort()
            await err.abort()
            raise
        now = int(self._clock.now())
        return await self._store.publish(
            batch.id,
            expected,
            terminal,
            now,
            self._record(batch, out_id, "output", out_size, now),
            self._record(batch, err_id, "error", err_size, now),
        )

    def _record(
        self, batch: BatchRecord, file_id: str, kind: str, size: int, now: int
    ) -> FileRecord:
        return FileRecord(
            id=file_id,
            org_id=batch.org_id,
            purpose=OUTPUT_PURPOSE,
            filename=f"{batch.id}_{kind}.jsonl",
            bytes=size,
            created_at=now,
            expires_at=now + (batch.output_expires_after_s or self._output_ttl_s),
            status="processed",
            batch_id=batch.id,
        )
