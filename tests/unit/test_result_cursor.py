"""The results endpoint's cursor: opaque, one spelling, nothing else decodes."""

from __future__ import annotations

import base64

import pytest

from backfill.domain.result_cursor import START, UNNUMBERED, ResultCursor


@pytest.mark.parametrize(
    "cursor",
    [
        START,
        UNNUMBERED,
        ResultCursor(True, 1),
        ResultCursor(False, 41),
        ResultCursor(True, 2**63 - 1),
    ],
)
def test_a_cursor_reads_back_as_itself(cursor: ResultCursor) -> None:
    text = cursor.encode()
    assert ResultCursor.decode(text) == cursor
    # URL-safe as it is: a query parameter without escaping.
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _b64(plain: str) -> str:
    return base64.urlsafe_b64encode(plain.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not a cursor",
        "!!!!",
        _b64("s:"),
        _b64("x:1"),
        _b64("s:-1"),
        _b64("s:01"),
        _b64("s: 1"),
        _b64("s:1 "),
        _b64("i:+3"),
        _b64(f"s:{2**63}"),
        _b64("s:1") + "=",  # padding is not part of the one spelling
        _b64("s:1")[:2] + "!" + _b64("s:1")[2:],  # the decoder would skip the stray character
        "A" * 200,
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        ResultCursor.decode(text)
