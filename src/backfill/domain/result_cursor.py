"""Where a reader of a batch's stored results stands (``GET /v1/batches/{id}/results``).

Results are read in two parts. First the rows in the order they were stored (``done_seq``,
numbered by the result write under the batch row's lock, so a number is never seen before
the ones below it). Then, once the batch is over, the rows that have no number: lines closed
without running (cancelled or expired batches) and results stored before numbering existed,
by line. The cursor names the part and the position in it; clients treat it as opaque.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from backfill.domain.records import StoredResult

# The database's BigInteger: a larger position cannot name a row, and would not bind.
_MAX_POSITION = 2**63 - 1
_PLAIN = re.compile(r"([si]):(0|[1-9][0-9]{0,18})")
# Longer than any cursor Backfill hands out: refused before decoding anything.
_MAX_TEXT = 40


@dataclass(frozen=True, slots=True)
class ResultCursor:
    """``numbered``: the first part, rows with ``done_seq > position``; otherwise the second
    part, unnumbered rows with ``idx >= position``."""

    numbered: bool
    position: int

    def encode(self) -> str:
        plain = f"{'s' if self.numbered else 'i'}:{self.position}"
        return base64.urlsafe_b64encode(plain.encode()).decode().rstrip("=")

    @staticmethod
    def decode(text: str) -> ResultCursor:
        """The cursor ``encode`` wrote; ValueError for anything else."""
        if not 0 < len(text) <= _MAX_TEXT:
            raise ValueError("cursor length")
        try:
            plain = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("ascii")
        except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
            raise ValueError("cursor encoding") from exc
        match = _PLAIN.fullmatch(plain)
        if match is None or int(match.group(2)) > _MAX_POSITION:
            raise ValueError("cursor shape")
        cursor = ResultCursor(match.group(1) == "s", int(match.group(2)))
        # The decoder skips characters outside the alphabet: only the one spelling is taken.
        if cursor.encode() != text:
            raise ValueError("cursor spelling")
        return cursor


START = ResultCursor(numbered=True, position=0)
# The second part from its first line.
UNNUMBERED = ResultCursor(numbered=False, position=0)


@dataclass(frozen=True, slots=True)
class PagedResult:
    """A stored result and the cursor that reads on from just after it."""

    result: StoredResult
    next: ResultCursor
