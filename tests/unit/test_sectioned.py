"""BatchRouter sectioned JSONL expanded into plain request lines (SPEC §8.1)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backfill.domain.input_format import LineError
from backfill.domain.scheduling.locality import prefix_key
from backfill.domain.sectioned import FORMAT, SectionedExpander, is_sectioned

HEADER = {"format": FORMAT}


def section(sid: str, body: dict[str, Any] | None = None, messages: Any = None) -> dict[str, Any]:
    inner: dict[str, Any] = {"id": sid}
    if body is not None:
        inner["body"] = body
    if messages is not None:
        inner["messages"] = messages
    return {"section": inner}


def request(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "body": body}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def expand(*lines: dict[str, Any] | bytes, first_line_no: int = 1) -> list[tuple[int, int, Any]]:
    expander = SectionedExpander()
    raw = [line if isinstance(line, bytes) else orjson.dumps(line) for line in lines]
    out = [(n, r, orjson.loads(e)) for n, r, e, _ in expander.expand(raw, first_line_no)]
    expander.finish(first_line_no + len(raw) - 1)
    return out


def failure(*lines: dict[str, Any] | bytes) -> LineError:
    with pytest.raises(LineError) as info:
        expand(*lines)
    return info.value


def test_request_body_overrides_section_body_and_messages_are_prefixed() -> None:
    system = {"role": "system", "content": "be brief"}
    out = expand(
        HEADER,
        section("s1", {"model": "m", "max_tokens": 8, "temperature": 0.5}, [system]),
        request("a", messages=[user("hi")], temperature=1),
        request("b", messages=[user("yo"), user("again")]),
        section("s2", {"model": "m", "max_tokens": 4}),
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},
    )
    assert [(n, r) for n, r, _ in out] == [(3, 1), (4, 2), (6, 3)]
    a, b, c = (line for _, _, line in out)
    assert a == {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "max_tokens": 8,
            "temperature": 1,
            "messages": [system, user("hi")],
        },
        "section": "s1",
    }
    assert b["body"]["messages"] == [system, user("yo"), user("again")]
    assert b["body"]["temperature"] == 0.5
    assert c == {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "max_tokens": 4, "prompt": "p"},
        "section": "s2",
    }


def test_values_are_kept_byte_for_byte() -> None:
    line = b'{"custom_id":"x\\u00e9","body":{"messages":[{"role":"user","content":"a"}],"n":1e400}}'
    expander = SectionedExpander()
    header = orjson.dumps(HEADER)
    sec = orjson.dumps(section("s", {"model": "m"}))
    ((_, _, expanded, _),) = list(expander.expand([header, sec, line], 1))
    assert b'"custom_id":"x\\u00e9"' in expanded
    assert b'"n":1e400' in expanded


def test_detection() -> None:
    assert is_sectioned(orjson.dumps(HEADER))
    assert not is_sectioned(orjson.dumps(request("a", model="m")))
    assert not is_sectioned(b"not json")


@pytest.mark.parametrize(
    ("lines", "line", "code", "param"),
    [
        ([{"format": "batchrouter.sectioned.v2"}], 1, "invalid_value", "format"),
        ([HEADER, request("a", model="m")], 2, "invalid_json_line", None),
        ([HEADER, section("s"), request("a"), section("s")], 4, "invalid_value", "section.id"),
        ([HEADER, section("s"), section("t"), request("a")], 2, "invalid_value", "section"),
        ([HEADER, section("s"), request("a"), section("t")], 4, "invalid_value", "section"),
        (
            [HEADER, section("s"), {"custom_id": "a", "body": {}, "section": "s"}],
            3,
            "invalid_value",
            "section",
        ),
        ([HEADER, section(""), request("a")], 2, "invalid_value", "section.id"),
        (
            [HEADER, section("s", {"messages": []}), request("a")],
            2,
            "invalid_value",
            "section.body.messages",
        ),
        (
            [HEADER, {"section": {"id": "s", "extra": 1}}, request("a")],
            2,
            "invalid_value",
            "section.extra",
        ),
        (
            [HEADER, {"section": {"body": {}}}, request("a")],
            2,
            "missing_required_parameter",
            "section.id",
        ),
        ([HEADER, section("s"), {"custom_id": "a"}], 3, "missing_required_parameter", "body"),
        ([HEADER, section("s"), {"custom_id": "a", "body": {}, "x": 1}], 3, "invalid_value", "x"),
        ([HEADER, section("s"), b""], 3, "invalid_json_line", None),
        ([HEADER, section("s"), b"[1]"], 3, "invalid_json_line", None),
        (
            [HEADER, section("s", None, [user("p")]), request("a", messages="no")],
            3,
            "invalid_value",
            "body.messages",
        ),
    ],
)
def test_broken_files_name_the_line_and_field(
    lines: list[Any], line: int, code: str, param: str | None
) -> None:
    error = failure(*lines)
    assert (error.line, error.code, error.param) == (line, code, param)
    assert error.message.startswith(f"Line {line}")


DEEP = 100_000


@pytest.mark.parametrize(
    "deep",
    [
        b'{"section":' * DEEP + b"{}" + b"}" * DEEP,
        b'{"section":{"id":"t","body":{"x":' + b"[" * DEEP + b"]" * DEEP + b"}}}",
        b'{"section":{"id":"t","messages":' + b"[" * DEEP + b"]" * DEEP + b"}}",
    ],
)
def test_a_section_line_nested_too_deeply_is_refused_as_such(deep: bytes) -> None:
    # The 2026-12-05 review, Info "deep section": this was "unknown field 'section'".
    error = failure(HEADER, section("s"), request("a"), deep)
    assert (error.line, error.code, error.param) == (4, "invalid_json_line", None)
    assert "nests JSON too deeply" in error.message
    assert not is_sectioned(b'{"format":' + b"[" * DEEP + b"]" * DEEP + b"}")


def test_a_file_without_its_header_line_is_refused_at_its_end() -> None:
    with pytest.raises(LineError) as info:
        SectionedExpander().finish(0)
    assert "starts with" in info.value.message


def test_errors_in_expanded_requests_name_what_the_user_wrote() -> None:
    expander = SectionedExpander()
    lines = [
        orjson.dumps(HEADER),
        orjson.dumps(section("s", {"model": "m", "max_tokens": 0, "n": 1}, [user("p")])),
        orjson.dumps(request("a", messages=[user("x"), user("y")], n=2)),
    ]
    ((_, _, _, origin),) = list(expander.expand(lines, 1))

    def said(param: str) -> tuple[int, str | None, str]:
        error = origin.attribute(
            LineError("invalid_value", f"Line 3: '{param}' bad.", line=3, param=param)
        )
        return error.line, error.param, error.message

    assert said("body.max_tokens") == (
        2,
        "section.body.max_tokens",
        "Line 2: 'section.body.max_tokens' bad.",
    )
    assert said("body.n")[:2] == (3, "body.n")
    assert said("body.messages[0].role")[:2] == (2, "section.messages[0].role")
    assert said("body.messages[2].content")[:2] == (3, "body.messages[1].content")
    assert said("body.messages")[:2] == (2, "section.messages")
    assert said("custom_id")[:2] == (3, "custom_id")


def test_requests_of_a_section_share_a_locality_key() -> None:
    out = expand(
        HEADER,
        section("s1", {"model": "m", "max_tokens": 8}),
        request("a", messages=[user("one"), user("two")]),
        request("b", messages=[user("three"), user("four")]),
        section("s2", {"model": "m", "max_tokens": 8}),
        request("c", messages=[user("one"), user("two")]),
    )
    keys = [prefix_key(orjson.dumps(line)) for _, _, line in out]
    assert keys[0] == keys[1]
    assert keys[0] != keys[2]
