"""LineSplitter: numbered lines out of a chunked byte stream (SPEC §3.1, §5.1, §5.5)."""

from __future__ import annotations

import pytest

from backfill.domain.input_format import Limits, LineError
from backfill.domain.lines import LineSplitter

BIG = Limits(max_file_bytes=1 << 30, max_lines=1_000_000, max_line_bytes=1 << 20)
Line = tuple[int, int, bytes]


def split(data: bytes, chunk_size: int | None = None, limits: Limits = BIG) -> list[Line]:
    splitter = LineSplitter(limits)
    out: list[Line] = []
    size = chunk_size or max(len(data), 1)
    for start in range(0, len(data), size):
        out.extend(splitter.feed(data[start : start + size]))
    out.extend(splitter.finish())
    assert splitter.total == len(data)
    return out


def split_error(data: bytes, chunk_size: int | None, limits: Limits) -> LineError:
    with pytest.raises(LineError) as info:
        split(data, chunk_size, limits)
    return info.value


DATA = b'{"a":1}\n{"bb":22}\n\xc3\xa9\n{"c":3}'
EXPECTED: list[Line] = [
    (1, 0, b'{"a":1}'),
    (2, 8, b'{"bb":22}'),
    (3, 18, b"\xc3\xa9"),
    (4, 21, b'{"c":3}'),
]


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 3, 7, 8, 9, 64])
def test_lines_offsets_and_numbers_do_not_depend_on_chunking(chunk_size: int | None) -> None:
    assert split(DATA, chunk_size) == EXPECTED


def test_final_newline_adds_no_line() -> None:
    assert split(DATA + b"\n") == EXPECTED


def test_each_offset_points_at_its_line_in_the_file() -> None:
    data = DATA + b"\n"
    for _, offset, raw in split(data, 5):
        assert data[offset : offset + len(raw)] == raw


def test_crlf_line_endings_are_stripped_but_offsets_stay_in_the_file() -> None:
    data = b"one\r\ntwo\r\nthree\r\n"
    assert split(data, 1) == [(1, 0, b"one"), (2, 5, b"two"), (3, 10, b"three")]
    assert split(b"one\r\ntwo") == [(1, 0, b"one"), (2, 5, b"two")]


def test_blank_lines_are_passed_on_numbered() -> None:
    assert split(b"a\n\nb\n") == [(1, 0, b"a"), (2, 2, b""), (3, 3, b"b")]
    assert split(b"a\n\r\nb") == [(1, 0, b"a"), (2, 2, b""), (3, 4, b"b")]


def test_empty_stream_has_no_lines() -> None:
    assert split(b"") == []
    splitter = LineSplitter(BIG)
    assert list(splitter.feed(b"")) == []
    assert list(splitter.finish()) == []


def test_a_lone_newline_is_one_blank_line() -> None:
    assert split(b"\n") == [(1, 0, b"")]


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_line_of_exactly_the_limit_is_accepted(chunk_size: int | None) -> None:
    limits = Limits(max_file_bytes=1000, max_lines=100, max_line_bytes=5)
    assert split(b"12345\nabcde", chunk_size, limits) == [(1, 0, b"12345"), (2, 6, b"abcde")]


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_crlf_line_of_exactly_the_limit_is_accepted(chunk_size: int | None) -> None:
    """The line ending is not part of the line: CRLF and LF files have the same line limit."""
    limits = Limits(max_file_bytes=1000, max_lines=100, max_line_bytes=5)
    assert split(b"12345\r\nabcde\r\n", chunk_size, limits) == [
        (1, 0, b"12345"),
        (2, 7, b"abcde"),
    ]


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
@pytest.mark.parametrize(
    ("data", "line"),
    [
        (b"123456\nok\n", 1),
        (b"ok\n123456\nok\n", 2),
        (b"ok\nok\n123456", 3),
        (b"ok\nok\n1234567890123", 3),
    ],
)
def test_line_over_the_limit_is_line_too_large(
    data: bytes, line: int, chunk_size: int | None
) -> None:
    limits = Limits(max_file_bytes=1000, max_lines=100, max_line_bytes=5)
    error = split_error(data, chunk_size, limits)
    assert error.code == "line_too_large"
    assert error.line == line
    assert f"Line {line} " in error.message
    assert "5 bytes" in error.message


def test_a_long_line_is_rejected_before_it_ends() -> None:
    """A line with no newline in sight is refused once it outgrows the limit, not buffered."""
    limits = Limits(max_file_bytes=1 << 30, max_lines=100, max_line_bytes=10)
    splitter = LineSplitter(limits)
    assert list(splitter.feed(b"ok\n0123456789")) == [(1, 0, b"ok")]
    with pytest.raises(LineError) as info:
        list(splitter.feed(b"x"))
    assert info.value.code == "line_too_large"
    assert info.value.line == 2


def test_file_of_exactly_the_limit_is_accepted() -> None:
    limits = Limits(max_file_bytes=10, max_lines=100, max_line_bytes=100)
    assert split(b"1234\n6789\n", None, limits) == [(1, 0, b"1234"), (2, 5, b"6789")]


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 10, None])
def test_file_over_the_limit_names_the_line_that_crosses_it(chunk_size: int | None) -> None:
    # Lines of 10 bytes each (with the newline); byte 26 (the first over 25) is in line 3.
    limits = Limits(max_file_bytes=25, max_lines=100, max_line_bytes=100)
    error = split_error(b"aaaaaaaaa\n" * 5, chunk_size, limits)
    assert error.code == "file_too_large"
    assert error.line == 3
    assert "line 3" in error.message.lower()
    assert "25 bytes" in error.message
