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
cannot be crafted to make the probes collide. The table is an ``array`` that grows by eight
(fewer rehashes of a big file) before a page of lines could fill it past half, so a page's ids
go in without it growing.

A page's ids go in together (``add_ids``): in C where ``_speedups`` was built, which takes the
hashes a few ids ahead and prefetches their slots (a big table misses the cache on almost every
probe); the same probes in Python otherwise.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from itertools import accumulate

_MIN_SLOTS = 1 << 12
_GROWTH = 8


def add_ids_py(table: array[int], ids: list[str], start: int) -> int:
    """Store ``hash(id) or 1`` of each of ``ids[start:]`` at the first free slot (0) from
    ``hash & mask``, until one is already in the table; return that id's index, not stored, or
    ``len(ids)`` when all were stored. ``_speedups.add_ids`` does the same in C."""
    mask = len(table) - 1
    for i in range(max(start, 0), len(ids)):
        h = hash(ids[i]) or 1
        slot = h & mask
        while stored := table[slot]:
            if stored == h:
                return i
            slot = (slot + 1) & mask
        table[slot] = h
    return len(ids)


def rehash_py(old: array[int], new: array[int]) -> None:
    """Store every hash of ``old`` in the empty ``new``, as ``_speedups.rehash`` does."""
    mask = len(new) - 1
    for h in filter(None, old):  # the used slots, skipped to in C
        slot = h & mask
        while new[slot]:
            slot = (slot + 1) & mask
        new[slot] = h


try:
    from backfill.domain._speedups import add_ids, rehash
except ImportError:  # not compiled where Backfill was installed: the same probes in Python
    add_ids, rehash = add_ids_py, rehash_py

COMPILED = add_ids is not add_ids_py


class CustomIds:
    """The ids of one file so far. Add a page's ids with ``add_page`` after ``reserve``;
    ``add`` checks one id exactly."""

    def __init__(self, limit: int) -> None:
        # A file holds at most ``limit`` ids: the table never grows past twice that.
        self._largest = 1 << max(2 * limit - 1, 1).bit_length()
        self._reserved = 0
        self._pages: list[tuple[str, array[int]]] = []
        self.table = _table(_MIN_SLOTS)

    def reserve(self, lines: int) -> None:
        """Make room for up to ``lines`` more ids at most half full; call before a page of
        lines, whose ids may then go in without growing the table."""
        self._reserved += lines
        slots = len(self.table)
        if 2 * self._reserved <= slots or slots >= self._largest:
            return
        while 2 * self._reserved > slots and slots < self._largest:
            slots *= _GROWTH
        old, self.table = self.table, _table(min(slots, self._largest))
        rehash(old, self.table)

    def add_page(self, ids: list[str], start: int) -> int:
        """Put ``ids[start:]`` in, in order, until one equals an id before it (in the file or
        in ``ids``); return that one's index, not put in, or ``len(ids)``. Two ids alike only
        in hash (about one in 10^8 for a million ids) go in."""
        while (i := add_ids(self.table, ids, start)) < len(ids):
            if self._earlier(ids[i], ids[:i]):
                return i
            self._insert_alike(ids[i])
            start = i + 1
        return i

    def add(self, cid: str, pending: list[str]) -> bool:
        """Put ``cid`` in; False if an earlier id equals it. ``pending`` holds the ids of the
        page being checked, which ``keep`` has not stored yet."""
        if add_ids(self.table, [cid], 0) == 1:
            return True
        if self._earlier(cid, pending):
            return False
        self._insert_alike(cid)
        return True

    def keep(self, ids: list[str]) -> None:
        """Store a checked page's ids, in order, for the exact comparisons."""
        if ids:
            self._pages.append(("".join(ids), array("Q", accumulate(map(len, ids)))))

    def _insert_alike(self, cid: str) -> None:
        """Store the hash of an id whose equal hash is stored already (a different id): the
        exact comparisons find either by the hash."""
        table = self.table
        mask = len(table) - 1
        h = hash(cid) or 1
        slot = h & mask
        while table[slot]:
            slot = (slot + 1) & mask
        table[slot] = h

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
