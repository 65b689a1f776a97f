"""The custom_ids of one input file, held to find a duplicate: exact, in a third to a half of
the memory a ``set`` of the strings takes.

A set of a million short ids holds a million string objects and a table of pointers to them:
about 93 MB, most of an upload's peak memory. Here each id costs one 64-bit hash in an
open-addressing table (linear probing, at most half full: 16 to 128 bytes an id, and no more
than the file's line limit needs) and its characters in one joined string per page (a byte or
so a character, and 8 bytes for where it ends). The table answers "new" for almost every id
without touching a string; two equal hashes (a duplicate, or a collision of about one in 10^8
for a million ids) are settled by comparing the id with the stored ones.

The hash is Python's own ``hash`` of the string: SipHash with a key drawn per process, so a file
cannot be crafted to make the probes collide. The table is an ``array`` (its items are read
faster than a ``memoryview``'s) that grows by eight (fewer rehashes of a big file) before a
page of lines could fill it past half: the hot loop in ``input_format`` probes it inline, so
it must never grow under that loop.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from itertools import accumulate

_MIN_SLOTS = 1 << 12
_GROWTH = 8


class CustomIds:
    """The ids of one file so far. ``table`` and ``mask`` are read by the validator's hot loop,
    which stores ``hash(id) or 1`` (never 0, the empty slot's value) at the first free slot from
    ``h & mask``, exactly as ``add`` does."""

    def __init__(self, limit: int) -> None:
        # A file holds at most ``limit`` ids: the table never grows past twice that.
        self._largest = 1 << max(2 * limit - 1, 1).bit_length()
        self._reserved = 0
        self._pages: list[tuple[str, array[int]]] = []
        self.table = _table(_MIN_SLOTS)
        self.mask = _MIN_SLOTS - 1

    def reserve(self, lines: int) -> None:
        """Make room for up to ``lines`` more ids at most half full; call before a page of
        lines, whose ids may then go in without growing the table."""
        self._reserved += lines
        slots = self.mask + 1
        if 2 * self._reserved <= slots or slots >= self._largest:
            return
        while 2 * self._reserved > slots and slots < self._largest:
            slots *= _GROWTH
        slots = min(slots, self._largest)
        old = self.table
        self.table = table = _table(slots)
        self.mask = mask = slots - 1
        for h in filter(None, old):  # the used slots, skipped to in C
            slot = h & mask
            while table[slot]:
                slot = (slot + 1) & mask
            table[slot] = h

    def add(self, cid: str, pending: list[str]) -> bool:
        """Put ``cid`` in; False if an earlier id equals it. ``pending`` holds the ids of the
        page being checked, which ``keep`` has not stored yet."""
        h = hash(cid) or 1
        table, mask = self.table, self.mask
        slot = h & mask
        while stored := table[slot]:
            if stored == h and self._earlier(cid, pending):
                return False
            slot = (slot + 1) & mask
        table[slot] = h
        return True

    def keep(self, ids: list[str]) -> None:
        """Store a checked page's ids, in order, for the exact comparisons."""
        if ids:
            self._pages.append(("".join(ids), array("Q", accumulate(map(len, ids)))))

    def _earlier(self, cid: str, pending: list[str]) -> bool:
        if cid in pending:
            return True
        size = len(cid)
        for joined, ends in self._pages:
            at = joined.find(cid)
            while at >= 0:
                # The id that holds position ``at``: a match must be the whole of it.
                i = bisect_right(ends, at)
                start = ends[i - 1] if i else 0
                if start == at and ends[i] == at + size:
                    return True
                at = joined.find(cid, at + 1)
        return False


def _table(slots: int) -> array[int]:
    return array("q", [0]) * slots
