"""The rules of one batch input line (SPEC §5.1-5.6), applied by LineValidator."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import orjson
import pytest

from backfill.domain.catalog import CatalogModel
from backfill.domain.input_format import (
    MAX_CUSTOM_ID_BYTES,
    Limits,
    LineError,
    LineValidator,
    custom_id_of,
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


def reject(line: dict[str, Any] | bytes, line_no: int = 1) -> LineError:
    data = line if isinstance(line, bytes) else raw(line)
    with pytest.raises(LineError) as info:
        validator().check(data, line_no)
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
    assert v.check(raw(chat("abc")), 1) == "abc"
    summary = v.summary()
    assert (summary.lines, summary.model, summary.endpoint) == (
        1,
        "text-model",
        "/v1/chat/completions",
    )


def test_valid_completions_line() -> None:
    v = validator()
    assert v.check(raw(completion("c1")), 1) == "c1"
    assert v.check(raw(completion("c2", prompt=["a", "b"])), 2) == "c2"
    assert v.summary().endpoint == "/v1/completions"


def test_many_lines_are_counted() -> None:
    v = validator()
    for i in range(1, 51):
        assert v.check(raw(chat(f"r{i}")), i) == f"r{i}"
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
    assert validator().check(raw(line), 1) == line["custom_id"]


def test_line_with_surrounding_whitespace_is_accepted() -> None:
    assert validator().check(b"  " + raw(chat()) + b" \t", 1) == "req-1"


def test_max_completion_tokens_takes_precedence_over_max_tokens() -> None:
    assert validator().check(raw(chat(max_tokens=5000, max_completion_tokens=10)), 1)
    error = reject(chat(max_tokens=10, max_completion_tokens=5000))
    assert_error(error, "invalid_value", "body.max_completion_tokens")


def test_custom_id_of_and_request_body_read_a_valid_line() -> None:
    line = chat("the-id", temperature=0.5)
    assert custom_id_of(raw(line)) == "the-id"
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


@pytest.mark.parametrize("key", ["extra", "model", "metadata"])
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
    v.check(raw(chat("a")), 1)
    with pytest.raises(LineError) as info:
        v.check(raw(completion("b")), 2)
    assert_error(info.value, "invalid_url", "url", line=2)


def test_duplicate_custom_id_names_the_second_line() -> None:
    v = validator()
    v.check(raw(chat("a")), 1)
    v.check(raw(chat("b")), 2)
    with pytest.raises(LineError) as info:
        v.check(raw(chat("a")), 3)
    assert_error(info.value, "duplicate_custom_id", "custom_id", line=3)
    assert "'a'" in info.value.message


def test_custom_ids_are_compared_byte_exact() -> None:
    v = validator()
    for i, cid in enumerate(["a", "A", "a ", " a", "\u00e9", "e\u0301"], start=1):
        assert v.check(raw(chat(cid)), i) == cid


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
    v.check(raw(chat("a")), 1)
    v.check(raw(chat("b")), 2)
    with pytest.raises(LineError) as info:
        v.check(raw(chat("c", model="other-model")), 3)
    assert_error(info.value, "mixed_models", "body.model", line=3)
    assert "other-model" in info.value.message
    assert "text-model" in info.value.message


def test_unknown_model_after_a_good_one_is_mixed_models() -> None:
    v = validator()
    v.check(raw(chat("a")), 1)
    with pytest.raises(LineError) as info:
        v.check(raw(chat("b", model="gpt-9")), 2)
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


def test_stream_true_on_completions_is_streaming_unsupported() -> None:
    assert_error(reject(completion(stream=True)), "streaming_unsupported", "body.stream")


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
        v.check(raw(chat(f"r{i}")), i)
    with pytest.raises(LineError) as info:
        v.check(raw(chat("r4")), 4)
    assert_error(info.value, "too_many_requests_in_file", None, line=4)
    assert "3" in info.value.message


def test_a_byte_order_mark_is_named() -> None:
    error = reject(b"\xef\xbb\xbf" + raw(chat()))
    assert_error(error, "invalid_json_line", None)
    assert "byte order mark" in error.message
