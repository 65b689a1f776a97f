"""What a file is: its record, purposes and statuses, where its bytes live, its line index,
and how long it is kept."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

from backfill.domain.lines import LineRef


class FilePurpose(StrEnum):
    BATCH = "batch"
    """An uploaded input file."""
    BATCH_OUTPUT = "batch_output"
    """A batch's output or error file."""


class FileStatus(StrEnum):
    PROCESSED = "processed"
    """Validated (inputs) or written (outputs): readable."""
    DELETED = "deleted"
    """Its content is gone; the row stays so ids are never reused."""


class InputFormat(StrEnum):
    """How an input file's requests were written (SPEC §5, §8.1)."""

    JSONL = "jsonl"
    """One request per line."""
    SECTIONED = "batchrouter.sectioned.v1"
    """BatchRouter sections of shared parameters and prefix messages, each followed by its
    requests; stored expanded, one request per line."""


@dataclass(slots=True)
class FileRecord:
    id: str
    org_id: str
    purpose: FilePurpose
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None
    status: FileStatus
    lines: int = 0
    model: str | None = None
    endpoint: str | None = None
    batch_id: str | None = None
    prompt_token_bound: int = 0
    max_output_tokens: int = 0
    input_format: InputFormat = InputFormat.JSONL


def output_record(
    file_id: str, batch_id: str, org_id: str, kind: str, size: int, now: int, ttl_s: int
) -> FileRecord:
    """The record of a batch's ``output`` or ``error`` file, kept ``ttl_s`` from ``now``."""
    return FileRecord(
        id=file_id,
        org_id=org_id,
        purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch_id}_{kind}.jsonl",
        bytes=size,
        created_at=now,
        expires_at=now + ttl_s,
        status=FileStatus.PROCESSED,
        batch_id=batch_id,
    )


# An accepted batch keeps its input at least this long past its deadline: a batch that ends
# early lets it go at once (``input_expires_at`` at publish), one that runs late still has it.
ACCEPTED_INPUT_GRACE_S = 24 * 3600


def content_key(file_id: str) -> str:
    """The blob holding a file's bytes."""
    return f"files/{file_id}"


def index_key(file_id: str) -> str:
    """The blob holding an input file's line index (``LineIndex``)."""
    return f"files/{file_id}.index"


def accepted_input_expiry(deadline: int) -> int:
    """How long an accepted batch keeps its input: past its deadline, so a batch that runs
    late still has it (``input_expiry_at_publish`` shortens it when the batch ends)."""
    return deadline + ACCEPTED_INPUT_GRACE_S


def input_expiry_at_publish(current: int | None, now: int) -> int:
    """When a finished batch's input may go: now, unless it was due to go sooner. The janitor
    still keeps it while another unfinished batch reads it."""
    return now if current is None else min(current, now)


def past_expiry(expires_at: int | None, now: int) -> bool:
    """Whether a file is due for removal at ``now`` (the janitor's rule: ``expires_at <= now``).

    A due file reads as removed at once, before the janitor deletes it, unless an unfinished
    batch still reads it as its input (the janitor keeps those too).
    """
    return expires_at is not None and expires_at <= now


# How long a file may be asked to live (``expires_after`` of an upload, ``output_expires_after``
# of a batch): at least an hour, at most 30 days.
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600

_ENTRY = struct.Struct("<QIH")


class LineIndex:
    """The line index of an input file, kept beside its content so that creating a batch never
    parses the file again. For each request line, in order: its byte offset in the content
    (u64), its length with any trailing CR (u32) and the UTF-8 length of its custom_id (u16),
    little-endian, then the custom_id itself."""

    @staticmethod
    def encode(offset: int, lines: list[bytes], custom_ids: list[str]) -> tuple[bytes, int]:
        """The entries of consecutive ``lines`` (each without its newline), the first of which
        starts at ``offset``; and where the line after them starts."""
        pack = _ENTRY.pack
        parts: list[bytes] = []
        for raw, custom_id in zip(lines, custom_ids, strict=True):
            cid = custom_id.encode()
            parts.append(pack(offset, len(raw), len(cid)))
            parts.append(cid)
            offset += len(raw) + 1
        return b"".join(parts), offset

    @staticmethod
    def decode(blob: bytes, first_idx: int = 0) -> tuple[list[LineRef], int]:
        """The whole entries at the start of ``blob``, numbered from ``first_idx``, and how many
        bytes they take: an index is read in parts, and an entry may straddle two."""
        size = _ENTRY.size
        unpack = _ENTRY.unpack_from
        refs: list[LineRef] = []
        pos = 0
        idx = first_idx
        while len(blob) - pos >= size:
            offset, length, cid_len = unpack(blob, pos)
            start = pos + size
            if len(blob) - start < cid_len:
                break
            refs.append(LineRef(idx, offset, length, blob[start : start + cid_len].decode()))
            pos = start + cid_len
            idx += 1
        return refs, pos
