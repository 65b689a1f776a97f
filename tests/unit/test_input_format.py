"""The rules of one batch input line (SPEC §5.1-5.6), applied by LineValidator.check_lines."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.domain.catalog import CatalogModel
from backfill.domain.input_format import (
    MAX_CUSTOM_ID_BYTES,
    Limits,
    LineError,
    LineValidator,
    request_body,
)
from backfill.domain.money import Prices

PRICES = Prices(100, 50, 400)
TEXT = CatalogModel(
    "text-model", "text-v1", context_length=4096, max_output_tokens=1024, prices=PRICES
)
OTHER = CatalogModel(
    "other-model", "other-v1", context_length=4096, max_output_tokens=1024, prices=PRICES
)
VISION = CatalogModel(
    "vision-model", "vision-v1", 4096, 512, modalities=frozenset({"text", "image"}), prices=PRICES
)
AUDIO = CatalogModel(
    "audio-model", "audio-v1", 4096, 512, modalities=frozenset({"text", "audio"}), prices=PRICES
)
NO_BATCH = CatalogModel("no-batch-model", "no-batch-v1", 4096, 1024)
CATALOG = {m.id: m for m in (TEXT, OTHER, VISION, AUDIO, NO_BATCH)}
LIMITS = Limits(max_file_bytes=1 << 30, max_lines=1000, max_line_bytes=1 << 20)


def validator(limits: Limits = LIMITS) -> LineValidator:
    return LineValidator(limits, CATALOG.get)


def chat(custom_id: str = "req-1", **body: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "text-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
        },
    }
    line["body"].update(body)
    return line


def completion(custom_id: str = "req-1", **body: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "text-model", "prompt": "Once upon a time", "max_tokens": 16},
    }
    line["body"].update(body)
    return line


def raw(line: dict[str, Any]) -> bytes:
    return orjson.dumps(line)


def check(v: LineValidator, data: bytes, line_no: int) -> str:
    """One line through the upload's own path; its ``custom_id``."""
    (custom_id,) = v.check_lines([data], line_no)
    return custom_id


def reject(line: dict[str, Any] | bytes, line_no: int = 1) -> LineError:
    data = line if isinstance(line, bytes) else raw(line)
    with pytest.raises(LineError) as info:
        validator().check_lines([data], line_no)
    return info.value


def assert_error(error: LineError, code: str, param: str | None, line: int = 1) -> None:
    assert error.code == code, error.message
    assert error.param == param, error.message
    assert error.line == line
    assert error.message.startswith(f"Line {line}"), error.message
    if param is not None:
        assert param in error.message


def without(line: dict[str, Any], *path: str) -> dict[str, Any]:
    out = copy.deepcopy(line)
    target = out
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return out


def image_part() -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def audio_part() -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def with_parts(model: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return chat(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}],
    )


# ---- valid lines -------------------------------------------------------------------------


def test_valid_chat_line_returns_its_custom_id() -> None:
    v = validator()
    assert check(v, raw(chat("abc")), 1) == "abc"
    summary = v.summary()
    assert (summary.lines, summary.model, summary.endpoint) == (
        1,
        "text-model",
        "/v1/chat/completions",
    )


def test_valid_completions_line() -> None:
    v = validator()
    assert check(v, raw(completion("c1")), 1) == "c1"
    assert check(v, raw(completion("c2", prompt=["a", "b"])), 2) == "c2"
    assert v.summary().endpoint == "/v1/completions"


def test_many_lines_are_counted() -> None:
    v = validator()
    for i in range(1, 51):
        assert check(v, raw(chat(f"r{i}")), i) == f"r{i}"
    assert v.summary().lines == 50


def test_summary_of_nothing() -> None:
    summary = validator().summary()
    assert (summary.lines, summary.model, summary.endpoint) == (0, None, None)


@pytest.mark.parametrize(
    "line",
    [
        chat(max_tokens=None, max_completion_tokens=32),
        chat(max_tokens=1),
        chat(max_tokens=1024),
        chat(stream=False),
        chat(stream=None),
        chat(temperature=0.2, top_p=0.9, seed=7, response_format={"type": "json_object"}),
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "developer", "content": "really"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "t1"},
                {"role": "function", "content": "{}", "name": "f"},
            ]
        ),
        chat("\u00e9" * (MAX_CUSTOM_ID_BYTES // 2)),
        chat("x" * MAX_CUSTOM_ID_BYTES),
        chat('with spaces / and "quotes" and \u2603'),
        with_parts("vision-model", image_part()),
        with_parts(
            "vision-model", {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
        ),
        with_parts("audio-model", audio_part()),
    ],
)
def test_valid_variants_are_accepted(line: dict[str, Any]) -> None:
    assert check(validator(), raw(line), 1) == line["custom_id"]


def test_line_with_surrounding_whitespace_is_accepted() -> None:
    assert check(validator(), b"  " + raw(chat()) + b" \t", 1) == "req-1"


def test_max_completion_tokens_takes_precedence_over_max_tokens() -> None:
    assert check(validator(), raw(chat(max_tokens=5000, max_completion_tokens=10)), 1)
    error = reject(chat(max_tokens=10, max_completion_tokens=5000))
    assert_error(error, "invalid_value", "body.max_completion_tokens")


def test_check_lines_and_request_body_read_a_valid_line() -> None:
    line = chat("the-id", temperature=0.5)
    assert validator().check_lines([raw(line)], 1) == ["the-id"]
    body = request_body(raw(line))
    assert msgspec.json.decode(msgspec.json.encode(body)) == line["body"]


def test_request_body_keeps_what_a_json_encoder_would_refuse_byte_exact() -> None:
    nested = "[" * 300 + "]" * 300
    text = (
        '{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":{"model":"m",'
        '"messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
        f'"seed":1180591620717411303424,"temperature":1e400,"tools":{nested}}}}}'
    )
    body = request_body(text.encode())
    encoded = msgspec.json.encode(body)
    assert b'"seed":1180591620717411303424' in encoded
    assert b'"temperature":1e400' in encoded
    assert nested.encode() in encoded


# ---- §5.1 line structure -----------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"not json",
        b'{"custom_id": "a",}',
        b"{'custom_id': 'a'}",
        raw(chat()) + raw(chat("b")),
        raw(chat())[:-1],
    ],
)
def test_invalid_json_is_invalid_json_line(data: bytes) -> None:
    assert_error(reject(data, 7), "invalid_json_line", None, line=7)


@pytest.mark.parametrize("data", [b"[1, 2]", b"123", b'"text"', b"null", b"true"])
def test_json_that_is_not_an_object_is_invalid_json_line(data: bytes) -> None:
    """§5.1: one JSON *object* per line; any other JSON value is not a request line."""
    assert_error(reject(data, 3), "invalid_json_line", None, line=3)


@pytest.mark.parametrize("data", [b"", b"   ", b"\t", b"\r"])
def test_blank_line_is_invalid_json_line(data: bytes) -> None:
    error = reject(data, 2)
    assert_error(error, "invalid_json_line", None, line=2)
    assert "empty" in error.message


@pytest.mark.parametrize(
    "data",
    [
        raw(chat("caf\u00e9")).replace(b"caf\xc3\xa9", b"caf\xe9"),
        raw(chat()).replace(b"hello", b"hel\xfflo"),
        b"\xff\xfe{}",
    ],
)
def test_non_utf8_bytes_are_invalid_json_line(data: bytes) -> None:
    assert_error(reject(data), "invalid_json_line", None)


@pytest.mark.parametrize("key", ["extra", "model", "metadata", ""])
def test_unknown_top_level_key_is_rejected(key: str) -> None:
    line = chat()
    line[key] = "x"
    error = reject(line)
    assert_error(error, "invalid_value", key)


@pytest.mark.parametrize("field", ["custom_id", "method", "url", "body"])
def test_missing_top_level_field_is_missing_required_parameter(field: str) -> None:
    assert_error(reject(without(chat(), field)), "missing_required_parameter", field)


def test_missing_body_model_is_missing_required_parameter() -> None:
    error = reject(without(chat(), "body", "model"))
    assert_error(error, "missing_required_parameter", "body.model")


def test_missing_role_is_missing_required_parameter() -> None:
    line = chat(messages=[{"content": "hi"}])
    assert_error(reject(line), "missing_required_parameter", "body.messages[0].role")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("custom_id", 12),
        ("custom_id", None),
        ("method", 1),
        ("url", ["/v1/completions"]),
        ("body", "text"),
        ("body", None),
    ],
)
def test_wrong_type_of_top_level_field_is_invalid_value(field: str, value: Any) -> None:
    line = chat()
    line[field] = value
    assert_error(reject(line), "invalid_value", field)


@pytest.mark.parametrize("method", ["GET", "post", "PUT", ""])
def test_method_other_than_post_is_invalid_value(method: str) -> None:
    line = chat()
    line["method"] = method
    error = reject(line)
    assert_error(error, "invalid_value", "method")


@pytest.mark.parametrize(
    "url",
    ["/v1/embeddings", "/v1/chat/completions/", "https://api.openai.com/v1/chat/completions", ""],
)
def test_unsupported_url_is_invalid_url(url: str) -> None:
    line = chat()
    line["url"] = url
    assert_error(reject(line), "invalid_url", "url")


def test_endpoint_change_between_lines_is_invalid_url() -> None:
    v = validator()
    check(v, raw(chat("a")), 1)
    with pytest.raises(LineError) as info:
        check(v, raw(completion("b")), 2)
    assert_error(info.value, "invalid_url", "url", line=2)


def test_duplicate_custom_id_names_the_second_line() -> None:
    v = validator()
    check(v, raw(chat("a")), 1)
    check(v, raw(chat("b")), 2)
    with pytest.raises(LineError) as info:
        check(v, raw(chat("a")), 3)
    assert_error(info.value, "duplicate_custom_id", "custom_id", line=3)
    assert "'a'" in info.value.message


def test_custom_ids_are_compared_byte_exact() -> None:
    v = validator()
    for i, cid in enumerate(["a", "A", "a ", " a", "\u00e9", "e\u0301"], start=1):
        assert check(v, raw(chat(cid)), i) == cid


@pytest.mark.parametrize(
    "custom_id", ["", "x" * (MAX_CUSTOM_ID_BYTES + 1), "\u00e9" * (MAX_CUSTOM_ID_BYTES // 2 + 1)]
)
def test_custom_id_outside_1_to_128_utf8_bytes_is_invalid_value(custom_id: str) -> None:
    error = reject(chat(custom_id))
    assert_error(error, "invalid_value", "custom_id")
    assert str(len(custom_id.encode())) in error.message


# ---- §5.2 model ----------------------------------------------------------------------------


def test_unknown_model_is_model_not_found() -> None:
    error = reject(chat(model="gpt-9"))
    assert_error(error, "model_not_found", "body.model")
    assert "gpt-9" in error.message


def test_model_without_batch_is_model_not_found() -> None:
    error = reject(chat(model="no-batch-model"))
    assert_error(error, "model_not_found", "body.model")
    assert "no-batch-model" in error.message


def test_second_model_in_file_is_mixed_models() -> None:
    v = validator()
    check(v, raw(chat("a")), 1)
    check(v, raw(chat("b")), 2)
    with pytest.raises(LineError) as info:
        check(v, raw(chat("c", model="other-model")), 3)
    assert_error(info.value, "mixed_models", "body.model", line=3)
    assert "other-model" in info.value.message
    assert "text-model" in info.value.message


def test_unknown_model_after_a_good_one_is_mixed_models() -> None:
    v = validator()
    check(v, raw(chat("a")), 1)
    with pytest.raises(LineError) as info:
        check(v, raw(chat("b", model="gpt-9")), 2)
    assert info.value.code in {"mixed_models", "model_not_found"}
    assert info.value.line == 2
    assert info.value.param == "body.model"


# ---- §5.3 max tokens, stream -----------------------------------------------------------------


def test_missing_max_tokens_is_missing_required_parameter() -> None:
    error = reject(chat(max_tokens=None))
    assert_error(error, "missing_required_parameter", "body.max_tokens")
    assert "max_completion_tokens" in error.message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1, 1025, 10**9])
def test_max_tokens_outside_1_to_model_limit_is_invalid_value(field: str, value: int) -> None:
    line = chat(max_tokens=None)
    line["body"][field] = value
    error = reject(line)
    assert_error(error, "invalid_value", f"body.{field}")
    assert "1024" in error.message


@pytest.mark.parametrize("value", [1.5, "16", True])
def test_max_tokens_not_an_integer_is_invalid_value(value: Any) -> None:
    assert_error(reject(chat(max_tokens=value)), "invalid_value", "body.max_tokens")


def test_stream_true_is_streaming_unsupported() -> None:
    assert_error(reject(chat(stream=True)), "streaming_unsupported", "body.stream")


@pytest.mark.parametrize("value", [0, 10, None, "high"])
def test_a_requests_own_priority_is_refused(value: Any) -> None:
    error = reject(chat(priority=value))
    assert_error(error, "unsupported_parameter", "body.priority")
    assert "Remove the field" in error.message


def test_stream_true_on_completions_is_streaming_unsupported() -> None:
    assert_error(reject(completion(stream=True)), "streaming_unsupported", "body.stream")


IGNORING_STREAM = Limits(
    max_file_bytes=1 << 30, max_lines=1000, max_line_bytes=1 << 20, ignore_stream=True
)


@pytest.mark.parametrize("make", [chat, completion])
def test_stream_true_is_accepted_where_the_operator_ignores_it(
    make: Callable[..., dict[str, Any]],
) -> None:
    v = validator(IGNORING_STREAM)
    line = make(stream=True, stream_options={"include_usage": True})
    assert check(v, raw(line), 1) == "req-1"
    assert check(v, raw(make("req-2", stream=False)), 2) == "req-2"


def test_stream_options_without_stream_is_refused_in_either_setting() -> None:
    for limits in (LIMITS, IGNORING_STREAM):
        for line in (
            chat(stream_options={"include_usage": True}),
            chat(stream=False, stream_options={}),
        ):
            with pytest.raises(LineError) as info:
                validator(limits).check_lines([raw(line)], 1)
            assert_error(info.value, "unsupported_parameter", "body.stream_options")
    assert check(validator(), raw(chat(stream_options=None)), 1) == "req-1"


def test_stream_options_after_many_common_lines_is_still_refused() -> None:
    # The strict decoder takes runs of common chat lines; this field must leave its path.
    v = validator()
    lines = [raw(chat(f"r{i}")) for i in range(100)]
    lines.append(raw(chat("bad", stream_options={"include_usage": True})))
    with pytest.raises(LineError) as info:
        v.check_lines(lines, 1)
    assert_error(info.value, "unsupported_parameter", "body.stream_options", line=101)


# ---- §5.4 messages, prompt, modalities -------------------------------------------------------


@pytest.mark.parametrize("messages", [[], None])
def test_empty_or_missing_messages_is_missing_required_parameter(messages: Any) -> None:
    line = chat(messages=messages)
    if messages is None:
        line = without(line, "body", "messages")
    assert_error(reject(line), "missing_required_parameter", "body.messages")


def test_messages_not_an_array_is_invalid_value() -> None:
    assert_error(reject(chat(messages="hello")), "invalid_value", "body.messages")


@pytest.mark.parametrize("role", ["bot", "USER", "", "human"])
def test_unknown_role_is_invalid_value(role: str) -> None:
    line = chat(messages=[{"role": "user", "content": "a"}, {"role": role, "content": "b"}])
    assert_error(reject(line), "invalid_value", "body.messages[1].role")


def test_completions_without_prompt_is_missing_required_parameter() -> None:
    line = without(completion(), "body", "prompt")
    assert_error(reject(line), "missing_required_parameter", "body.prompt")


def test_image_part_for_text_model_is_unsupported_modality() -> None:
    error = reject(with_parts("text-model", image_part()))
    assert_error(error, "unsupported_modality", "body.messages[0].content[1]")
    assert "image" in error.message


def test_https_image_part_for_text_model_is_unsupported_modality() -> None:
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    error = reject(with_parts("text-model", part))
    assert_error(error, "unsupported_modality", "body.messages[0].content[1]")


def test_audio_part_for_text_model_is_unsupported_modality() -> None:
    error = reject(with_parts("text-model", audio_part()))
    assert_error(error, "unsupported_modality", "body.messages[0].content[1]")
    assert "audio" in error.message


def test_audio_part_for_image_model_is_unsupported_modality() -> None:
    error = reject(with_parts("vision-model", audio_part()))
    assert_error(error, "unsupported_modality", "body.messages[0].content[1]")


def test_image_part_for_audio_model_is_unsupported_modality() -> None:
    error = reject(with_parts("audio-model", image_part()))
    assert_error(error, "unsupported_modality", "body.messages[0].content[1]")


def test_unknown_content_part_type_is_invalid_value() -> None:
    error = reject(with_parts("text-model", {"type": "video", "video": {}}))
    assert_error(error, "invalid_value", "body.messages[0].content[1].type")


def test_content_part_without_type_is_missing_required_parameter() -> None:
    error = reject(with_parts("text-model", {"text": "x"}))
    assert_error(error, "missing_required_parameter", "body.messages[0].content[1].type")


# ---- §5.5 line count ---------------------------------------------------------------------


def test_line_past_max_lines_is_too_many_requests_in_file() -> None:
    v = validator(Limits(max_file_bytes=1 << 30, max_lines=3, max_line_bytes=1 << 20))
    for i in range(1, 4):
        check(v, raw(chat(f"r{i}")), i)
    with pytest.raises(LineError) as info:
        check(v, raw(chat("r4")), 4)
    assert_error(info.value, "too_many_requests_in_file", None, line=4)
    assert "3" in info.value.message


def test_a_byte_order_mark_is_named() -> None:
    error = reject(b"\xef\xbb\xbf" + raw(chat()))
    assert_error(error, "invalid_json_line", None)
    assert "byte order mark" in error.message


# ---- many lines in one call --------------------------------------------------------------


def test_one_call_checks_many_lines_and_names_a_bad_one_by_its_own_number() -> None:
    v = validator()
    lines = [raw(chat(f"r{i}")) for i in range(1, 6)]
    assert v.check_lines(lines, 1) == [f"r{i}" for i in range(1, 6)]
    later = [raw(chat("r6")), raw(chat("r7", stream=True)), raw(chat("r8"))]
    with pytest.raises(LineError) as info:
        v.check_lines(later, 6)
    assert_error(info.value, "streaming_unsupported", "body.stream", line=7)


def test_lines_within_max_lines_are_checked_before_the_count() -> None:
    v = validator(Limits(max_file_bytes=1 << 30, max_lines=3, max_line_bytes=1 << 20))
    lines = [raw(chat("a")), b"{", raw(chat("c")), raw(chat("d"))]
    assert_error(reject_in(v, lines), "invalid_json_line", None, line=2)


def reject_in(v: LineValidator, lines: list[bytes], first_line_no: int = 1) -> LineError:
    with pytest.raises(LineError) as info:
        v.check_lines(lines, first_line_no)
    return info.value


# ---- one pass over a file says what each line alone says -------------------------------------
#
# ``check_lines`` takes a fast path for a line like the ones before it, which restates some rules
# of the detailed checks; a fresh validator always takes the detailed checks. The files below keep
# to one model, one endpoint and distinct ids, so only rules of a single line can be broken.

Mutation = Callable[[dict[str, Any]], dict[str, Any] | bytes]


def _parent(line: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The object holding ``path``'s last key; None once an earlier mutation removed it."""
    target: Any = line
    for key in path[:-1]:
        target = target.get(key) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else None


def _set(path: tuple[str, ...], value: Any) -> Mutation:
    def mutate(line: dict[str, Any]) -> dict[str, Any]:
        if (parent := _parent(line, path)) is not None:
            parent[path[-1]] = copy.deepcopy(value)
        return line

    return mutate


def _drop(*path: str) -> Mutation:
    def mutate(line: dict[str, Any]) -> dict[str, Any]:
        if (parent := _parent(line, path)) is not None:
            parent.pop(path[-1], None)
        return line

    return mutate


def _bytes(make: Callable[[bytes], bytes]) -> Mutation:
    return lambda line: make(raw(line))


MUTATIONS: list[Mutation] = [
    _set(("custom_id",), ""),
    _set(("custom_id",), "x" * (MAX_CUSTOM_ID_BYTES + 1)),
    _set(("custom_id",), "\u00e9" * (MAX_CUSTOM_ID_BYTES // 2 + 1)),
    _set(("custom_id",), 12),
    _set(("method",), "GET"),
    _set(("url",), "/v1/images/generations"),
    _set(("extra",), 1),
    _drop("method"),
    _drop("body"),
    _set(("body",), "text"),
    _drop("body", "model"),
    _set(("body", "stream"), True),
    _set(("body", "stream"), False),
    _set(("body", "max_tokens"), None),
    _set(("body", "max_tokens"), 0),
    _set(("body", "max_tokens"), 1),
    _set(("body", "max_tokens"), 512),
    _set(("body", "max_tokens"), 513),
    _set(("body", "max_tokens"), 1025),
    _set(("body", "max_tokens"), True),
    _set(("body", "max_tokens"), "16"),
    _set(("body", "max_completion_tokens"), 8),
    _set(("body", "max_completion_tokens"), 5000),
    _set(("body", "messages"), []),
    _drop("body", "messages"),
    _drop("body", "max_tokens"),
    _set(("body", "messages"), None),
    _set(("body", "messages"), "hello"),
    _set(("body", "messages"), [{"role": "bot", "content": "b"}]),
    _set(("body", "messages"), [{"content": "b"}]),
    _set(("body", "messages"), [{"role": "assistant", "content": None}]),
    _set(("body", "messages"), [{"role": "user", "content": [{"type": "text", "text": "t"}]}]),
    _set(("body", "messages"), [{"role": "user", "content": [image_part()]}]),
    _set(("body", "messages"), [{"role": "user", "content": [audio_part()]}]),
    _set(("body", "messages"), [{"role": "user", "content": [{"type": "video"}]}]),
    _set(("body", "messages"), [{"role": "user", "content": [{"text": "t"}]}]),
    _set(("body", "prompt"), None),
    _set(("body", "prompt"), ["a", "b"]),
    _set(("body", "prompt"), 5),
    _set(("body", "priority"), 1),
    _set(("body", "tools"), [{"type": "function", "function": {"name": "f"}}]),
    _set(("body", "tools"), [{"type": "mcp", "server_url": "http://169.254.169.254/"}]),
    _set(("body", "tools"), [{"type": "function"}, {"type": "file_search"}]),
    _set(("body", "tools"), None),
    _set(("body", "tools"), "function"),
    _set(("body", "store"), True),
    _set(("body", "store"), False),
    _set(("body", "store"), None),
    _set(("body", "previous_response_id"), "resp_1"),
    _set(("body", "previous_response_id"), None),
    _set(("body", "web_search_options"), {}),
    _set(("body", "response_format"), {"type": "json_object"}),
    _set(("body", "response_format"), {"type": "json_schema", "json_schema": {"schema": {}}}),
    _set(("body", "response_format"), {"type": "json_schema", "json_schema": {"schema": []}}),
    _set(
        ("body", "response_format"), {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}
    ),
    _set(("body", "max_output_tokens"), "8"),
    _set(("body", "messages"), [{"role": "developer", "content": "d"}, {"role": "tool"}]),
    _bytes(lambda data: b""),
    _bytes(lambda data: b"{"),
    _bytes(lambda data: b"[1]"),
    _bytes(lambda data: b"\xef\xbb\xbf" + data),
    _bytes(lambda data: data + b"\r"),
    _bytes(lambda data: data.replace(b"POST", b"P\xffST")),
]


@st.composite
def files(draw: st.DrawFn) -> tuple[Limits, list[bytes]]:
    model = draw(st.sampled_from(["text-model", "vision-model", "audio-model"]))
    template = chat if draw(st.booleans()) else completion
    count = draw(st.integers(1, 12))
    lines: list[bytes] = []
    for i in range(1, count + 1):
        # A long id makes the fast path count its bytes; the number keeps ids distinct.
        cid = draw(st.sampled_from([f"r{i}", f"{i}-" + "\u00e9" * 62, f"{i}-" + "a" * 40]))
        line: dict[str, Any] | bytes = template(cid, model=model)
        # Most lines are left valid, so that a broken one often follows good ones.
        broken = draw(st.integers(0, 4)) == 0
        for mutation in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2)) * broken:
            if isinstance(line, dict):
                line = mutation(line)
        lines.append(line if isinstance(line, bytes) else raw(line))
    max_lines = draw(st.sampled_from([1000, 1000, 1000, max(count - 1, 1), max(count // 2, 1)]))
    return Limits(max_file_bytes=1 << 30, max_lines=max_lines, max_line_bytes=1 << 20), lines


def _outcome(error: LineError) -> tuple[str, str, str | None, int]:
    return error.code, error.message, error.param, error.line


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(files())
def test_one_pass_raises_exactly_what_each_line_alone_raises(
    file: tuple[Limits, list[bytes]],
) -> None:
    limits, lines = file
    expected: tuple[str, str, str | None, int] | None = None
    alone: list[LineValidator] = []
    alone_ids: list[str] = []
    for line_no, line in enumerate(lines, start=1):
        fresh = validator(limits)
        try:
            alone_ids += fresh.check_lines([line], line_no)
        except LineError as exc:
            expected = _outcome(exc)
            break
        alone.append(fresh)
    whole = validator(limits)
    if expected is not None:
        assert _outcome(reject_in(whole, lines)) == expected
        return
    ids = whole.check_lines(lines, 1)
    assert ids == alone_ids
    summary = whole.summary()
    assert summary.lines == len(lines)
    assert summary.prompt_token_bound == sum(v.summary().prompt_token_bound for v in alone)
    assert summary.max_output_tokens == sum(v.summary().max_output_tokens for v in alone)
