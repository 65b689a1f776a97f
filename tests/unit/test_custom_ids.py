"""The compact set of a file's custom_ids: it answers as a ``set`` of the strings would, across
pages, through growth and when two different ids share a hash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.domain.custom_ids import CustomIds
from backfill.domain.input_format import LineError
from tests.unit.test_input_format import chat, completion, raw, validator


class Colliding(str):
    """A different id with the same hash as every other: only the exact comparison tells
    them apart."""

    def __hash__(self) -> int:
        return 42


def add_pages(known: CustomIds, pages: list[list[str]]) -> list[bool]:
    """Each id through ``add`` as the validator does: a page reserved, then kept."""
    answers: list[bool] = []
    for page in pages:
        known.reserve(len(page))
        pending: list[str] = []
        for cid in page:
            new = known.add(cid, pending)
            answers.append(new)
            if new:
                pending.append(cid)
        known.keep(pending)
    return answers


# Short ids over two letters: many duplicates, and ids that are runs of others joined ("ab" is
# "a" then "b" in a page's joined string), which must not count as present.
ids = st.text(alphabet="ab\u00e9", min_size=1, max_size=4)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(st.lists(ids, max_size=8), max_size=6))
def test_it_answers_as_a_set_of_the_strings(pages: list[list[str]]) -> None:
    seen: set[str] = set()
    expected: list[bool] = []
    for page in pages:
        for cid in page:
            expected.append(cid not in seen)
            seen.add(cid)
    assert add_pages(CustomIds(1_000_000), pages) == expected


def test_equal_hashes_of_different_ids_are_told_apart_by_their_strings() -> None:
    first: list[str] = [Colliding("a"), Colliding("b")]
    second: list[str] = [Colliding("c"), Colliding("ab"), Colliding("a"), Colliding("c")]
    assert add_pages(CustomIds(1_000_000), [first, second]) == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]


def test_it_grows_without_losing_or_inventing_an_id() -> None:
    known = CustomIds(100_000)
    pages = [[f"id-{p}-{i}" for i in range(5_000)] for p in range(20)]
    assert all(add_pages(known, pages))
    # Grown by eights from 4,096 slots to the limit's, where it stays: at most half full.
    assert known.mask + 1 == 1 << 18
    again = [[f"id-{p}-{i}" for i in range(0, 5_000, 97)] for p in range(20)]
    assert not any(add_pages(known, again))


def test_the_validator_finds_a_duplicate_on_a_later_page_on_both_paths() -> None:
    for line in (chat, completion):
        v = validator()
        v.check_lines([raw(line(f"r{i}")) for i in range(1, 301)], 1)
        v.check_lines([raw(line(f"r{i}")) for i in range(301, 401)], 301)
        with pytest.raises(LineError) as info:
            v.check_lines([raw(line("r400x")), raw(line("r40"))], 401)
        assert (info.value.code, info.value.line) == ("duplicate_custom_id", 402)


def test_the_validators_inline_probe_settles_an_equal_hash_by_the_strings() -> None:
    v = validator()
    v.check_lines([raw(chat("a"))], 1)
    # An id that no line holds put in the table where "b" goes: "b" then meets an equal hash.
    known = v._ids
    known.reserve(1)
    h = hash("b") or 1
    slot = h & known.mask
    while known.table[slot]:
        slot = (slot + 1) & known.mask
    known.table[slot] = h
    assert v.check_lines([raw(chat("b")), raw(chat("c"))], 2) == ["b", "c"]
    with pytest.raises(LineError) as info:
        v.check_lines([raw(chat("b"))], 4)
    assert (info.value.code, info.value.line) == ("duplicate_custom_id", 4)
