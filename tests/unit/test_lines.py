"""LineSplitter and LineIndex: numbered lines out of a chunked byte stream, and where each lies
in the file (SPEC §3.1, §5.1, §5.5)."""

from __future__ import annotations

import pytest

from backfill.domain.files import LineIndex
from backfill.domain.input_format import Limits, LineError
from backfill.domain.lines import LineRef, LineSplitter

BIG = Limits(max_file_bytes=1 << 30, max_lines=1_000_000, max_line_bytes=1 << 20)
Line = tuple[int, int, bytes]


def split(data: bytes, chunk_size: int | None = None, limits: Limits = BIG) -> list[Line]:
    """Each line with its number and its offset in ``data``, as an upload reads them: fed in
    chunks, then written to a line index and read back."""
    splitter = LineSplitter(limits)
    numbered: list[tuple[int, bytes]] = []
    index = b""
    offset = 0

    def take(first_line_no: int, lines: list[bytes]) -> None:
        nonlocal index, offset
        assert first_line_no == len(numbered) + 1
        numbers = range(first_line_no, first_line_no + len(lines))
        numbered.extend(zip(numbers, lines, strict=True))
        entries, offset = LineIndex.encode(offset, lines, [str(n) for n in numbers])
        index += entries

    size = chunk_size or max(len(data), 1)
    for start in range(0, len(data), size):
        take(*splitter.feed_lines(data[start : start + size]))
        splitter.raise_pending()
    take(*splitter.finish_lines())
    assert splitter.total == len(data)
    refs, used = LineIndex.decode(index)
    assert used == len(index)
    out: list[Line] = []
    for ref, (line_no, raw) in zip(refs, numbered, strict=True):
        assert (ref.idx, ref.custom_id, ref.length) == (line_no - 1, str(line_no), len(raw))
        out.append((line_no, ref.offset, raw))
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


def test_crlf_lines_keep_their_cr_and_offsets_stay_in_the_file() -> None:
    """JSON reads the CR as whitespace, so it stays with its line."""
    data = b"one\r\ntwo\r\nthree\r\n"
    assert split(data, 1) == [(1, 0, b"one\r"), (2, 5, b"two\r"), (3, 10, b"three\r")]
    assert split(b"one\r\ntwo") == [(1, 0, b"one\r"), (2, 5, b"two")]


def test_blank_lines_are_passed_on_numbered() -> None:
    assert split(b"a\n\nb\n") == [(1, 0, b"a"), (2, 2, b""), (3, 3, b"b")]
    assert split(b"a\n\r\nb") == [(1, 0, b"a"), (2, 2, b"\r"), (3, 4, b"b")]


def test_empty_stream_has_no_lines() -> None:
    assert split(b"") == []
    splitter = LineSplitter(BIG)
    assert splitter.feed_lines(b"") == (1, [])
    assert splitter.finish_lines() == (1, [])


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
        (1, 0, b"12345\r"),
        (2, 7, b"abcde\r"),
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
    assert splitter.feed_lines(b"ok\n0123456789") == (1, [b"ok"])
    splitter.raise_pending()
    assert splitter.feed_lines(b"x") == (2, [])
    with pytest.raises(LineError) as info:
        splitter.raise_pending()
    assert info.value.code == "line_too_large"
    assert info.value.line == 2


def test_lines_before_a_long_one_are_returned_for_checking_first() -> None:
    """The error of a long line waits until the lines before it have been checked, so an earlier
    bad line is reported whatever the chunks: as it is when they arrive one by one."""
    limits = Limits(max_file_bytes=1 << 30, max_lines=100, max_line_bytes=10)
    splitter = LineSplitter(limits)
    assert splitter.feed_lines(b"{\nok\n" + b"x" * 11 + b"\nok\n") == (1, [b"{", b"ok"])
    with pytest.raises(LineError) as info:
        splitter.raise_pending()
    assert (info.value.code, info.value.line) == ("line_too_large", 3)
    with pytest.raises(LineError):
        splitter.feed_lines(b"more")


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


def test_the_line_index_reads_back_in_parts_of_any_size() -> None:
    """An index is streamed from storage: an entry may straddle two parts."""
    lines = [b'{"a":1}', b"", b"\xc3\xa9\r", b"x" * 300]
    ids = ["one", "", "\u00e9t\u00e9", "4" * 128]
    index, end = LineIndex.encode(7, lines, ids)
    assert end == 7 + sum(len(raw) + 1 for raw in lines)
    for part in (1, 2, 13, 14, 15, len(index)):
        refs: list[LineRef] = []
        buffer = b""
        for start in range(0, len(index), part):
            buffer += index[start : start + part]
            decoded, used = LineIndex.decode(buffer, len(refs))
            refs.extend(decoded)
            buffer = buffer[used:]
        assert buffer == b""
        assert [(r.idx, r.offset, r.length, r.custom_id) for r in refs] == [
            (0, 7, 7, "one"),
            (1, 15, 0, ""),
            (2, 16, 3, "\u00e9t\u00e9"),
            (3, 20, 300, "4" * 128),
        ]
