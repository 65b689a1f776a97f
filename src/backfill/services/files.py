"""Files API use cases: streamed, validated uploads and downloads (SPEC §3, §5)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from backfill.domain import ids
from backfill.domain.catalog import CatalogModel, by_name
from backfill.domain.files import (
    MAX_EXPIRY_S,
    MIN_EXPIRY_S,
    FilePurpose,
    FileRecord,
    FileStatus,
    InputFormat,
    LineIndex,
    content_key,
    index_key,
    past_expiry,
)
from backfill.domain.input_format import Limits, LineError, LineValidator
from backfill.domain.lines import LineRef, LineSplitter
from backfill.domain.records import Page
from backfill.domain.reruns import rerun_key
from backfill.domain.sectioned import Origin, SectionedExpander, is_sectioned
from backfill.errors import (
    Conflict,
    ContentUnreadable,
    InvalidInput,
    NotFound,
    retained_input_limit,
)
from backfill.ports import BlobStore, BlobWriter, Catalog, Clock, FileStore

log = logging.getLogger("backfill.files")


class Upload:
    """One upload in flight: validates each chunk as it arrives, encrypting it to storage."""

    def __init__(
        self,
        service: FileService,
        org_id: str,
        content: BlobWriter,
        index: BlobWriter,
        file_id: str,
        models: dict[str, CatalogModel],
        retained: int = 0,
    ) -> None:
        self._service = service
        self._org_id = org_id
        self._content = content
        self._index = index
        self.file_id = file_id
        limits = service.limits
        self._splitter = LineSplitter(limits)
        self._validator = LineValidator(limits, models.get)
        self._finished = False
        self._offset = 0
        self._retained = retained  # the org's input bytes when the upload began
        self._received = 0
        # Known at the first line: a sectioned file is stored expanded (domain/sectioned.py).
        self._expander: SectionedExpander | None = None
        self._begun = False

    async def feed(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._expander is None:
            self._check_quota(self._received)
        entries = b""
        try:
            first, lines = self._splitter.feed_lines(chunk)
            if not self._begun and lines:
                self._begin(lines[0])
            if self._expander is not None:
                await self._expand(first, lines)
            else:
                entries = self._entries(first, lines)
            self._splitter.raise_pending()
        except LineError as exc:
            raise _invalid(exc) from None
        if self._expander is None:
            await self._content.write(chunk)
            if entries:
                await self._index.write(entries)

    def _begin(self, first_line: bytes) -> None:
        self._begun = True
        if is_sectioned(first_line):
            self._expander = SectionedExpander()

    def _check_quota(self, size: int) -> None:
        """The org's retained input, counted in stored bytes: a sectioned file's expanded."""
        limit = self._service.max_retained_input_bytes
        if limit is not None and self._retained + size > limit:
            # Stop at the first chunk past the quota; abort() removes what was written.
            raise retained_input_limit(self._retained, size, limit)

    def _entries(
        self, first_line_no: int, lines: list[bytes], first_request: int | None = None
    ) -> bytes:
        """Validate ``lines`` and return their line index entries."""
        if not lines:
            return b""
        ids = self._validator.check_lines(lines, first_line_no, first_request)
        entries, self._offset = LineIndex.encode(self._offset, lines, ids)
        return entries

    async def _expand(self, first_line_no: int, lines: list[bytes]) -> None:
        """Expand a sectioned file's lines and store their requests, validated as plain lines,
        a bounded run at a time: a long prefix repeated in every request never piles up."""
        assert self._expander is not None
        requests = self._expander.expand(lines, first_line_no)
        run: list[bytes] = []
        origins: list[Origin] = []
        run_line = run_request = last_line = size = 0
        while True:
            try:
                line_no, request_no, expanded, origin = next(requests)
            except StopIteration:
                break
            except LineError:
                # An earlier bad request is the one reported, wherever the runs were cut.
                await self._store_run(run, origins, run_line, run_request)
                raise
            if run and (line_no != last_line + 1 or size >= _EXPANDED_RUN_BYTES):
                await self._store_run(run, origins, run_line, run_request)
                run, origins, size = [], [], 0
            if not run:
                run_line, run_request = line_no, request_no
            run.append(expanded)
            origins.append(origin)
            size += len(expanded) + 1
            last_line = line_no
        await self._store_run(run, origins, run_line, run_request)

    async def _store_run(
        self, run: list[bytes], origins: list[Origin], first_line_no: int, first_request: int
    ) -> None:
        """Validate and store consecutive expanded requests; an error names what the user
        wrote (a section's shared part is its section line's)."""
        if not run:
            return
        try:
            entries = self._entries(first_line_no, run, first_request)
        except LineError as exc:
            index = exc.line - first_line_no
            raise origins[index].attribute(exc) if 0 <= index < len(origins) else exc from None
        self._check_quota(self._offset)
        limit = self._service.limits.max_expanded_bytes
        if self._offset > limit:
            raise LineError(
                "file_too_large",
                f"Line {first_line_no + len(run) - 1}: the file's requests, expanded with their "
                f"sections, take more than {limit} bytes; split it into several batches.",
                line=first_line_no + len(run) - 1,
            )
        await self._content.write(b"\n".join(run) + b"\n")
        await self._index.write(entries)

    async def finish(self, purpose: str | None, expires_after_s: int | None) -> FileRecord:
        if purpose != FilePurpose.BATCH:
            raise InvalidInput(
                f"'purpose' must be 'batch' (it is {purpose!r}); only batch input files can be "
                "uploaded.",
                code="invalid_value" if purpose else "missing_required_parameter",
                param="purpose",
            )
        try:
            first, last = self._splitter.finish_lines()
            if not self._begun and last:
                self._begin(last[0])
            if self._expander is not None:
                await self._expand(first, last)
                self._expander.finish(self._splitter.line_no)
                tail = b""
            else:
                tail = self._entries(first, last)
        except LineError as exc:
            raise _invalid(exc) from None
        summary = self._validator.summary()
        if summary.lines == 0:
            raise InvalidInput(
                "The file has no requests; put one JSON request per line.",
                code="invalid_json_line",
                param="file",
                line=1,
            )
        if tail:
            await self._index.write(tail)
        size = await self._content.commit()
        await self._index.commit()
        now = int(self._service.clock.now())
        ttl = expires_after_s if expires_after_s is not None else self._service.input_ttl_s
        record = FileRecord(
            id=self.file_id,
            org_id=self._org_id,
            purpose=FilePurpose.BATCH,
            filename=f"{self.file_id}.jsonl",
            bytes=size,
            created_at=now,
            expires_at=now + ttl,
            status=FileStatus.PROCESSED,
            lines=summary.lines,
            model=summary.model,
            endpoint=summary.endpoint,
            prompt_token_bound=summary.prompt_token_bound,
            max_output_tokens=summary.max_output_tokens,
            input_format=InputFormat.SECTIONED if self._expander else InputFormat.JSONL,
        )
        # The quota again, atomically with the row: concurrent uploads each saw the old total.
        await self._service.store.create_file(record, self._service.max_retained_input_bytes)
        self._finished = True
        return record

    async def abort(self) -> None:
        if not self._finished:
            await self._content.abort()
            await self._index.abort()
            # One blob may already be committed when the other failed: remove both.
            await self._service.blobs.delete(content_key(self.file_id))
            await self._service.blobs.delete(index_key(self.file_id))


# How much of a sectioned file's expansion is validated and written at a time.
_EXPANDED_RUN_BYTES = 1 << 20


def _invalid(exc: LineError) -> InvalidInput:
    return InvalidInput(exc.message, code=exc.code, param=exc.param, line=exc.line)


def parse_expires_after(anchor: str | None, seconds: str | None) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidInput(
            "'expires_after[anchor]' must be 'created_at'.",
            code="invalid_value",
            param="expires_after[anchor]",
        )
    try:
        value = int(seconds or "")
    except ValueError:
        value = -1
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise InvalidInput(
            f"'expires_after[seconds]' must be a whole number from {MIN_EXPIRY_S} to "
            f"{MAX_EXPIRY_S} (it is {seconds!r}).",
            code="invalid_value",
            param="expires_after[seconds]",
        )
    return value


class FileService:
    def __init__(
        self,
        store: FileStore,
        blobs: BlobStore,
        catalog: Catalog,
        clock: Clock,
        limits: Limits,
        input_ttl_s: int,
        max_retained_input_bytes: int | None = None,
        on_damage: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.catalog = catalog
        self.clock = clock
        self.limits = limits
        self.input_ttl_s = input_ttl_s
        # Per org, over its input files that are not deleted (SPEC §7.6); None: no limit.
        self.max_retained_input_bytes = max_retained_input_bytes
        # Counts stored content found damaged here, by kind (the blob store counts its own).
        self._on_damage = on_damage

    async def begin_upload(self, org_id: str) -> Upload:
        """Start an upload; refused before any byte is read when the org's quota is spent."""
        retained = 0
        if self.max_retained_input_bytes is not None:
            retained = await self.store.retained_input_bytes(org_id, int(self.clock.now()))
            if retained >= self.max_retained_input_bytes:
                raise retained_input_limit(retained, 0, self.max_retained_input_bytes)
        file_id = ids.file_id()
        content = await self.blobs.writer(content_key(file_id))
        index = await self.blobs.writer(index_key(file_id))
        # One snapshot of the catalog per upload: every line is checked against the same one.
        models = by_name(await self.catalog.all(org_id))
        return Upload(self, org_id, content, index, file_id, models, retained)

    async def find(self, org_id: str, file_id: str) -> FileRecord | None:
        """The org's file, None when there is none or it reads as removed (``removed``)."""
        record = await self.store.get_file(org_id, file_id)
        return None if record is None or await self.removed(record) else record

    async def get(self, org_id: str, file_id: str, *, param: str = "file_id") -> FileRecord:
        """The org's file; NotFound when there is none or it reads as removed, with a message
        that says which (``param`` names the field that held ``file_id``)."""
        record = await self.store.get_file(org_id, file_id)
        if record is None or await self.removed(record):
            raise _not_found(file_id, record, int(self.clock.now()), param)
        return record

    async def removed(self, record: FileRecord) -> bool:
        """Whether ``record`` reads as removed: deleted, or past its expiry and read by no
        unfinished batch. The second is what the janitor deletes at its next sweep; until then
        the file answers as it will afterwards (SPEC §10.3: accepted input goes at completion),
        so no reader sees content the retention rules say is gone."""
        if record.status == FileStatus.DELETED:
            return True
        if not past_expiry(record.expires_at, int(self.clock.now())):
            return False
        return await self.store.unfinished_batch_for_file(record.id) is None

    async def expired(self, now: int, limit: int) -> list[FileRecord]:
        """Files past their expiry that no unfinished batch needs, for the janitor."""
        return await self.store.expired_files(now, limit)

    async def list_files(
        self, org_id: str, purpose: str | None, after: str | None, limit: int, order: str
    ) -> Page[FileRecord]:
        if not 1 <= limit <= 10000:
            raise InvalidInput(
                f"'limit' must be from 1 to 10000 (it is {limit}).",
                code="invalid_value",
                param="limit",
            )
        if order not in ("asc", "desc"):
            raise InvalidInput(
                "'order' must be 'asc' or 'desc'.", code="invalid_value", param="order"
            )
        return await self.store.list_files(
            org_id, purpose, after, limit, order == "asc", now=int(self.clock.now())
        )

    async def delete(self, org_id: str, file_id: str) -> FileRecord:
        """Delete a file now. One past its expiry that the janitor has not swept yet is removed
        at once too (200, like any other): asking to delete it is asking for its bytes to go."""
        record = await self.store.get_file(org_id, file_id)
        if record is None or record.status == FileStatus.DELETED:
            raise _not_found(file_id, record, int(self.clock.now()), "file_id")
        if record.purpose == FilePurpose.BATCH:
            batch = await self.store.unfinished_batch_for_file(file_id)
            if batch is not None:
                raise Conflict(
                    f"File {file_id} is the input of batch {batch}, which has not finished; "
                    "cancel the batch or wait for it to end.",
                    code="file_in_use",
                )
        await self.remove(record)
        return record

    async def remove(self, record: FileRecord) -> None:
        """Delete a file's bytes (and a result file's per-request results), then mark it."""
        await self.blobs.delete(content_key(record.id))
        await self.blobs.delete(index_key(record.id))
        if record.purpose == FilePurpose.BATCH_OUTPUT:
            # An error file's rerun input lives and goes with it (domain/reruns.py).
            await self.blobs.delete(rerun_key(record.id))
        if record.purpose == FilePurpose.BATCH_OUTPUT and record.batch_id:
            await self.store.purge_results(record.batch_id)
        await self.store.mark_file_deleted(record.id)

    def content(
        self, record: FileRecord, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        return self.blobs.stream(content_key(record.id), start, end)

    async def check_stored_size(self, record: FileRecord) -> None:
        """Raise ContentUnreadable (counted, logged with the file id) when the stored content
        is not the size its record says: a Content-Length taken from the record would then be
        a promise the body cannot keep."""
        stored = await self.blobs.size(content_key(record.id))
        if stored != record.bytes:
            self.report_damage(record.id, "size_mismatch", f"{stored} bytes stored")
            raise ContentUnreadable(
                f"The stored content of file {record.id!r} has {stored} bytes, not the "
                f"{record.bytes} its record says; it cannot be served. Report the file id to "
                "the operator: it must be restored from a backup."
            )

    def report_damage(self, file_id: str, kind: str, detail: str) -> None:
        """Log and count damage found in a file's stored content; ids and sizes, never content."""
        log.error(
            "stored file damaged: file_id=%s kind=%s (%s); restore it from a backup",
            file_id,
            kind,
            detail,
        )
        if self._on_damage is not None:
            self._on_damage(kind)

    async def lines(self, file_id: str, chunk: int = 5000) -> AsyncIterator[list[LineRef]]:
        """Where each request line of an input file starts, and its custom_id, ``chunk`` at a
        time: the index is streamed, so a million-line file never sits in memory at once."""
        buffer = b""
        refs: list[LineRef] = []
        idx = 0
        async for part in self.blobs.stream(index_key(file_id)):
            buffer += part
            decoded, used = LineIndex.decode(buffer, idx)
            buffer = buffer[used:]
            idx += len(decoded)
            refs.extend(decoded)
            while len(refs) >= chunk:
                yield refs[:chunk]
                del refs[:chunk]
        if refs:
            yield refs


def _not_found(file_id: str, record: FileRecord | None, now: int, param: str) -> NotFound:
    """The 404 of a file that does not exist, or exists and reads as removed; the second says
    why, in the same words before the janitor has swept it as after."""
    if record is None:
        return NotFound(f"No file with id {file_id!r}.", param=param)
    return NotFound(_removed_message(record, now), param=param)


def _removed_message(record: FileRecord, now: int) -> str:
    if record.expires_at is not None and past_expiry(record.expires_at, now):
        when = datetime.fromtimestamp(record.expires_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        again = "; upload it again to use it" if record.purpose == FilePurpose.BATCH else ""
        return (
            f"File {record.id!r} expired at {when} (expires_at {record.expires_at}) and is no "
            f"longer available{again}."
        )
    return f"File {record.id!r} was deleted and is no longer available."
