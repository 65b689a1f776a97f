"""The fast path of validation, in C (``_speedups.chat_run``) and in Python (``chat_run_py``):
both accept the same lines, stop at the same one and sum the same bounds; and a whole file
checked with the Python twins raises what each line alone raises, as with C."""

from __future__ import annotations

from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.unit.test_input_format as input_format_tests
from backfill.domain import custom_ids, input_format
from backfill.domain.input_format import MAX_CUSTOM_ID_BYTES, Body, Limits, RequestLine
from backfill.domain.strict_lines import chat_run_py, strict_chat_decoder
from tests.unit.test_input_format import TEXT, chat, raw

ERRORS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)
STRICT = strict_chat_decoder(RequestLine, Body, TEXT.id, TEXT.max_output_tokens)


def both(lines: list[bytes], start: int, context: int) -> list[tuple[object, ...]]:
    from backfill.domain._speedups import chat_run

    answers: list[tuple[object, ...]] = []
    for run in (chat_run, chat_run_py):
        ids: list[str] = ["before"]
        answers.append((*run(lines, start, STRICT, ERRORS, context, MAX_CUSTOM_ID_BYTES, ids), ids))
    return answers


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(input_format_tests.files(), st.integers(0, 14), st.sampled_from([4096, 200, 1]))
def test_the_c_and_python_runs_accept_the_same_lines(
    file: tuple[Limits, list[bytes]], start: int, context: int
) -> None:
    _, lines = file
    c, python = both(lines, start, context)
    assert c == python


def test_a_run_stops_where_only_the_detailed_checks_can_tell() -> None:
    lines = [
        raw(chat("a", max_tokens=5)),
        raw(chat("b", max_tokens=7, max_completion_tokens=9)),
        # 33 characters of 2 bytes: only its UTF-8 tells whether it is within 128 bytes.
        raw(chat("\u00e9" * 33, max_tokens=5)),
        raw(chat("c", max_tokens=5)),
    ]
    for stop, bound, output, missed, ids in both(lines, 0, 4096):
        assert (stop, output, missed, ids) == (2, 5 + 9, False, ["before", "a", "b"])
        assert bound == len(lines[0]) + len(lines[1]) + 2 * 8 * 2
    no_limit = raw(chat("d", max_tokens=None))
    section = raw({**chat("e", max_tokens=5), "section": ""})
    for line in (no_limit, section):
        assert {answer[:4] for answer in both([line], 0, 4096)} == {(0, 0, 0, False)}
    broken = raw(chat("f", max_tokens=10_000))
    bound = len(lines[0]) + 8 * 2
    assert {answer[:4] for answer in both([lines[0], broken], 0, 4096)} == {(1, bound, 5, True)}


def test_a_run_leaves_other_tools_and_engine_state_to_the_detailed_checks() -> None:
    # The 2026-12-05 review, finding L6: what the detailed checks refuse, the run must not
    # accept; function tools and nothing stored stay on the fast path.
    function = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for body in ({"tools": [function]}, {"store": False}, {"tools": None, "store": None}):
        line = raw(chat("a", max_tokens=5, **body))
        assert {answer[:4] for answer in both([line], 0, 4096)} == {(1, len(line) + 16, 5, False)}
    refused: list[dict[str, object]] = [
        {"tools": [{"type": "mcp", "server_url": "http://169.254.169.254/latest/"}]},
        {"tools": [function, {"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        {"tools": [{"name": "f"}]},
        {"tools": "function"},
        {"store": True},
        {"previous_response_id": "resp_1"},
        {"conversation": {"id": "conv_1"}},
        {"web_search_options": {}},
    ]
    for refusing in refused:
        line = raw(chat("b", max_tokens=5, **refusing))
        assert {answer[:4] for answer in both([line], 0, 4096)} == {(0, 0, 0, True)}, refusing


def test_the_c_run_refuses_what_is_not_a_page_of_lines() -> None:
    from backfill.domain._speedups import chat_run

    with pytest.raises(TypeError, match="not bytes"):
        chat_run(["line"], 0, STRICT, ERRORS, 1, 1, [])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be lists"):
        chat_run((b"",), 0, STRICT, ERRORS, 1, 1, [])  # type: ignore[arg-type]

    def fails(raw: bytes) -> object:
        raise KeyError(raw)

    # An error the run was not told to take as a refusal is the caller's.
    with pytest.raises(KeyError):
        chat_run([b"{}"], 0, fails, ERRORS, 1, 1, [])  # type: ignore[arg-type]


def test_a_file_checked_with_the_python_twins_raises_what_each_line_alone_raises() -> None:
    with (
        mock.patch.object(input_format, "chat_run", chat_run_py),
        mock.patch.object(custom_ids, "add_ids", custom_ids.add_ids_py),
        mock.patch.object(custom_ids, "rehash", custom_ids.rehash_py),
    ):
        input_format_tests.test_one_pass_raises_exactly_what_each_line_alone_raises()
