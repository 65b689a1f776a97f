"""The compact set of a file's custom_ids: it answers as a ``set`` of the strings would, across
pages, through growth and when two different ids share a hash; with its probes in C
(``_speedups``) and in Python alike."""

from __future__ import annotations

from array import array
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.domain import custom_ids
from backfill.domain.custom_ids import CustomIds, add_ids_py, rehash_py
from backfill.domain.input_format import LineError
from tests.unit.test_input_format import chat, completion, raw, validator


@pytest.fixture(autouse=True, params=["c", "python"])
def probes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs with the C probes and again with the Python ones."""
    if request.param == "c":
        from backfill.domain import _speedups

        monkeypatch.setattr(custom_ids, "add_ids", _speedups.add_ids)
        monkeypatch.setattr(custom_ids, "rehash", _speedups.rehash)
    else:
        monkeypatch.setattr(custom_ids, "add_ids", add_ids_py)
        monkeypatch.setattr(custom_ids, "rehash", rehash_py)
    return str(request.param)


def test_the_install_built_the_c_probes() -> None:
    # setup.py marks the module optional, so a failed compile would only show as slower
    # uploads: here it fails the suite. ``pip install -e .`` builds it again.
    assert custom_ids.COMPILED, "backfill.domain._speedups was not compiled"


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
    assert len(known.table) == 1 << 18
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
    mask = len(known.table) - 1
    h = hash("b") or 1
    slot = h & mask
    while known.table[slot]:
        slot = (slot + 1) & mask
    known.table[slot] = h
    assert v.check_lines([raw(chat("b")), raw(chat("c"))], 2) == ["b", "c"]
    with pytest.raises(LineError) as info:
        v.check_lines([raw(chat("b"))], 4)
    assert (info.value.code, info.value.line) == ("duplicate_custom_id", 4)


def add_by_pages(known: CustomIds, pages: list[list[str]]) -> list[bool]:
    """Each page's ids through ``add_page`` as the validator's fast path does: a duplicate's
    index comes back, and the page goes on after it."""
    answers: list[bool] = []
    for page in pages:
        known.reserve(len(page))
        start = 0
        while (dup := known.add_page(page, start)) < len(page):
            answers += [True] * (dup - start) + [False]
            # The validator stops at a duplicate; here the rest of the page goes on without it.
            page = page[:dup] + page[dup + 1 :]
            start = dup
        answers += [True] * (len(page) - start)
        known.keep(page)
    return answers


@pytest.mark.parametrize("add", [add_pages, add_by_pages])
@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(pages=st.lists(st.lists(ids, max_size=8), max_size=6))
def test_it_answers_as_a_set_of_the_strings(
    add: Callable[[CustomIds, list[list[str]]], list[bool]], pages: list[list[str]]
) -> None:
    seen: set[str] = set()
    expected: list[bool] = []
    for page in pages:
        for cid in page:
            expected.append(cid not in seen)
            seen.add(cid)
    assert add(CustomIds(1_000_000), pages) == expected


def test_a_page_of_ids_alike_in_hash_goes_in_and_a_repeat_is_found() -> None:
    known = CustomIds(1_000)
    known.reserve(4)
    page: list[str] = [Colliding("a"), Colliding("b"), Colliding("ab")]
    assert known.add_page(page, 0) == 3
    known.keep(page)
    known.reserve(2)
    assert known.add_page([Colliding("c"), Colliding("b")], 0) == 1


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    st.lists(st.text(max_size=6), max_size=40),
    st.integers(0, 45),
    st.sampled_from([1, 2, 64, 4096]),
)
def test_the_c_and_python_probes_store_the_same_table(
    page: list[str], start: int, slots: int
) -> None:
    from backfill.domain import _speedups

    tables = [array("q", [0]) * slots, array("q", [0]) * slots]
    # A table too small for the page fills up: only a page that fits is added to it.
    if len(set(page[start:])) >= slots:
        return
    answers = [
        add(table, page, start)
        for add, table in zip((_speedups.add_ids, add_ids_py), tables, strict=True)
    ]
    assert answers[0] == answers[1]
    assert tables[0] == tables[1]
    grown = [array("q", [0]) * (slots * 8), array("q", [0]) * (slots * 8)]
    _speedups.rehash(tables[0], grown[0])
    rehash_py(tables[1], grown[1])
    assert grown[0] == grown[1]


def test_the_c_probes_refuse_what_is_not_a_table_of_ids() -> None:
    from backfill.domain import _speedups

    table = array("q", [0]) * 8
    with pytest.raises(TypeError, match="power of two"):
        _speedups.add_ids(array("q", [0]) * 6, ["a"], 0)
    with pytest.raises(TypeError, match="power of two"):
        _speedups.add_ids(array("i", [0]) * 8, ["a"], 0)
    with pytest.raises(TypeError, match="not a str"):
        _speedups.add_ids(table, ["a", 5], 0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be a list"):
        _speedups.add_ids(table, ("a",), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="power of two"):
        _speedups.rehash(table, array("q", [0]) * 3)
