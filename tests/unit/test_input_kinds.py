"""Embeddings and Responses lines, endpoints per model, and the rules of media parts (SPEC §5)."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from backfill.domain.catalog import CatalogModel
from backfill.domain.endpoints import CHAT_URL, EMBEDDINGS_URL, RESPONSES_URL
from backfill.domain.input_format import Limits, LineError, LineValidator, request_body
from backfill.domain.media import (
    IMAGE_TYPES,
    MediaLimits,
    has_signature,
    inline_images,
    may_hold_remote_images,
    remote_image_urls,
)
from backfill.domain.money import Prices

PRICES = Prices(100, 50, 400)
CHAT_ONLY = CatalogModel("chat-model", "chat-v1", 4096, 1024, prices=PRICES)
EMBED = CatalogModel(
    "embed-model", "embed-v1", 4096, 1, prices=PRICES, endpoints=frozenset({EMBEDDINGS_URL})
)
RESPONDER = CatalogModel(
    "resp-model",
    "resp-v1",
    4096,
    512,
    modalities=frozenset({"text", "image", "audio"}),
    prices=PRICES,
    endpoints=frozenset({CHAT_URL, RESPONSES_URL}),
)
CATALOG = {m.id: m for m in (CHAT_ONLY, EMBED, RESPONDER)}
MEDIA = MediaLimits(part_bytes=1000, line_bytes=1500, parts_per_line=3)
LIMITS = Limits(max_file_bytes=1 << 30, max_lines=1000, max_line_bytes=1 << 20, media=MEDIA)


def check(*lines: dict[str, Any]) -> LineValidator:
    v = LineValidator(LIMITS, CATALOG.get)
    v.check_lines([orjson.dumps(line) for line in lines], 1)
    return v


def reject(*lines: dict[str, Any]) -> LineError:
    with pytest.raises(LineError) as info:
        check(*lines)
    return info.value


def embedding(custom_id: str = "e1", **body: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS_URL}
    line["body"] = {"model": "embed-model", "input": "the cat sat", **body}
    return line


def response(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": RESPONSES_URL}
    line["body"] = {"model": "resp-model", "input": "hello", "max_output_tokens": 32, **body}
    return line


def chat_parts(*parts: dict[str, Any], custom_id: str = "c1") -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_URL,
        "body": {
            "model": "resp-model",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}],
        },
    }


def png(size: int) -> str:
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * (size - 4)).decode()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


# ---- endpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]], ["x"] * 2048])
def test_embeddings_inputs_accepted(value: Any) -> None:
    summary = check(embedding(input=value)).summary()
    assert summary.endpoint == EMBEDDINGS_URL
    assert summary.max_output_tokens == 0


@pytest.mark.parametrize(
    "value", ["", [], [""], ["a", 1], [[]], [-1], [1.5], {"a": 1}, ["x"] * 2049]
)
def test_embeddings_bad_inputs_refused(value: Any) -> None:
    error = reject(embedding(input=value))
    assert (error.code, error.param) == ("invalid_value", "body.input")


def test_embeddings_need_input() -> None:
    line = embedding()
    del line["body"]["input"]
    error = reject(line)
    assert (error.code, error.param) == ("missing_required_parameter", "body.input")


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 5), ("messages", [{"role": "user", "content": "x"}]), ("prompt", "x")],
)
def test_embeddings_refuse_fields_of_other_endpoints(field: str, value: Any) -> None:
    error = reject(embedding(**{field: value}))
    assert (error.code, error.param) == ("invalid_value", f"body.{field}")
    assert "/v1/embeddings" in error.message


def test_embeddings_encoding_and_dimensions() -> None:
    check(embedding(encoding_format="base64", dimensions=16))
    assert reject(embedding(encoding_format="int8")).param == "body.encoding_format"
    assert reject(embedding(dimensions=0)).param == "body.dimensions"
    assert reject(embedding(dimensions=True)).param == "body.dimensions"


def test_responses_lines_accepted_and_bounded() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "yo"}],
        },
    ]
    summary = check(response(), response("r2", input=items, max_output_tokens=100)).summary()
    assert summary.max_output_tokens == 132


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"max_output_tokens": None}, "missing_required_parameter", "body.max_output_tokens"),
        ({"max_output_tokens": 513}, "invalid_value", "body.max_output_tokens"),
        ({"stream": True}, "streaming_unsupported", "body.stream"),
        ({"background": True}, "invalid_value", "body.background"),
        ({"max_tokens": 5}, "invalid_value", "body.max_tokens"),
        ({"input": ""}, "invalid_value", "body.input"),
        ({"input": []}, "invalid_value", "body.input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "invalid_value",
            "body.input[0].content[0].type",
        ),
        ({"input": [1, "x"]}, "invalid_value", "body.input[0]"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "invalid_value",
            "body.input[0]",
        ),
    ],
)
def test_responses_lines_refused(body: dict[str, Any], code: str, param: str) -> None:
    line = response()
    line["body"].update(body)
    if body.get("max_output_tokens", 0) is None:
        del line["body"]["max_output_tokens"]
    error = reject(line)
    assert (error.code, error.param) == (code, param)
    assert error.message.startswith("Line 1:")


def test_a_model_serves_only_its_endpoints() -> None:
    error = reject(embedding(model="chat-model"))
    assert (error.code, error.param) == ("invalid_url", "url")
    assert "chat-model" in error.message
    assert "/v1/chat/completions" in error.message
    chat_to_embedder = chat_parts()
    chat_to_embedder["body"]["model"] = "embed-model"
    assert reject(chat_to_embedder).code == "invalid_url"


# ---- tools and engine-side state (the 2026-12-05 review, finding L6) ---------------------

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
MCP = {"type": "mcp", "server_label": "x", "server_url": "http://169.254.169.254/latest/"}
FILE_SEARCH = {"type": "file_search", "vector_store_ids": ["vs_other_tenant"]}


def test_function_tools_and_nothing_stored_are_accepted() -> None:
    chat = chat_parts()
    chat["body"].update(tools=[FUNCTION], store=False, tool_choice="auto")
    check(chat)
    check(
        response(tools=[RESPONSES_FUNCTION], store=False),
        response("r2", tools=None, store=None, previous_response_id=None, conversation=None),
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tools": [MCP]}, "invalid_value", "body.tools[0].type"),
        ({"tools": [RESPONSES_FUNCTION, FILE_SEARCH]}, "invalid_value", "body.tools[1].type"),
        ({"tools": [{"type": "web_search"}]}, "invalid_value", "body.tools[0].type"),
        ({"tools": [{"name": "f"}]}, "invalid_value", "body.tools[0].type"),
        ({"tools": ["function"]}, "invalid_value", "body.tools[0]"),
        ({"tools": {"type": "function"}}, "invalid_value", "body.tools"),
        ({"previous_response_id": "resp_1"}, "unsupported_parameter", "body.previous_response_id"),
        ({"conversation": "conv_1"}, "unsupported_parameter", "body.conversation"),
        ({"conversation": {"id": "conv_1"}}, "unsupported_parameter", "body.conversation"),
        ({"store": True}, "invalid_value", "body.store"),
        ({"store": "no"}, "invalid_value", "body.store"),
    ],
)
def test_responses_lines_reaching_past_the_request_are_refused(
    body: dict[str, Any], code: str, param: str
) -> None:
    # The second line: a first line that was accepted does not open a way past the checks.
    error = reject(response(), response("r2", **body))
    assert (error.code, error.param, error.line) == (code, param, 2)
    assert error.message.startswith(f"Line 2: '{param}'"), error.message


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tools": [FUNCTION, MCP]}, "invalid_value", "body.tools[1].type"),
        ({"tools": [FILE_SEARCH]}, "invalid_value", "body.tools[0].type"),
        ({"web_search_options": {}}, "unsupported_parameter", "body.web_search_options"),
        ({"store": True}, "invalid_value", "body.store"),
        ({"previous_response_id": "resp_1"}, "unsupported_parameter", "body.previous_response_id"),
    ],
)
def test_chat_lines_reaching_past_the_request_are_refused(
    body: dict[str, Any], code: str, param: str
) -> None:
    line = chat_parts(custom_id="c2")
    line["body"].update(body)
    error = reject(chat_parts(), line)
    assert (error.code, error.param, error.line) == (code, param, 2)


# ---- media parts -------------------------------------------------------------------------


def test_inline_and_https_images_and_audio_accepted() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    check(chat_parts(image(png(100)), image("https://images.example/cat.png"), audio))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://images.example/cat.png", "https"),
        ("ftp://x/y.png", "https"),
        ("data:image/png,notbase64", "base64 data URL"),
        ("data:text/html;base64,PGI+", "media type"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("https:///nohost", "host"),
        ("", "non-empty"),
    ],
)
def test_bad_image_urls_name_the_field(url: str, words: str) -> None:
    error = reject(chat_parts(image(url)))
    assert error.param == "body.messages[0].content[1].image_url.url"
    assert words in error.message


def test_part_and_line_size_limits() -> None:
    assert "at most 1000 bytes" in reject(chat_parts(image(png(1200)))).message
    error = reject(chat_parts(image(png(900)), image(png(900))))
    assert error.param == "body.messages[0].content[2]"
    assert "1500" in error.message
    error = reject(chat_parts(*(image(png(10)) for _ in range(4))))
    assert "at most 3" in error.message


def test_bad_audio_refused() -> None:
    bad_format = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "ogg"}}
    assert reject(chat_parts(bad_format)).param == "body.messages[0].content[1].input_audio.format"
    no_data = {"type": "input_audio", "input_audio": {"format": "wav"}}
    assert reject(chat_parts(no_data)).code == "missing_required_parameter"


def test_responses_images_follow_the_same_rules() -> None:
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    error = reject(response(input=[item]))
    assert error.param == "body.input[0].content[0].image_url"


# ---- remote images when a request runs ---------------------------------------------------


def test_remote_images_are_found_and_swapped_for_inline_copies() -> None:
    line = chat_parts(image("https://a.example/1.png"), image(png(20)))
    line["body"]["messages"].append(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://b/2"}}]}
    )
    body = request_body(orjson.dumps(line))
    assert remote_image_urls(body) == ["https://a.example/1.png", "https://b/2"]
    swapped = inline_images(body, {"https://a.example/1.png": "data:image/png;base64,AA=="})
    messages = orjson.loads(bytes(swapped["messages"]))
    assert messages[0]["content"][1]["image_url"]["url"] == "data:image/png;base64,AA=="
    assert messages[1]["content"][0]["image_url"]["url"] == "https://b/2"
    # Fields without remote images stay the bytes the user wrote.
    assert swapped["max_tokens"] is body["max_tokens"]


@pytest.mark.parametrize("url", ["https:\\/\\/10.0.0.5/x.png", "\\u0068ttps://10.0.0.5/x.png"])
def test_escaped_remote_images_are_found(url: str) -> None:
    # An https URL spelled with JSON escapes is still a remote image, fetched by Backfill.
    line = orjson.dumps(chat_parts(image("PLACEHOLDER"))).replace(b"PLACEHOLDER", url.encode())
    assert may_hold_remote_images(line)
    check_line = LineValidator(LIMITS, CATALOG.get)
    check_line.check_lines([line], 1)
    assert remote_image_urls(request_body(line)) == ["https://10.0.0.5/x.png"]


def test_responses_remote_images_are_found() -> None:
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "https://c/3.png"}]}
    body = request_body(orjson.dumps(response(input=[item])))
    assert remote_image_urls(body) == ["https://c/3.png"]


# ---- plain http images where the operator allows them (the 2026-12-05 review, Info) -------


def test_http_images_are_accepted_when_allowed() -> None:
    allowed = Limits(
        max_file_bytes=1 << 30,
        max_lines=1000,
        max_line_bytes=1 << 20,
        media=MediaLimits(part_bytes=1000, line_bytes=1500, parts_per_line=3, allow_http=True),
    )
    LineValidator(allowed, CATALOG.get).check_lines(
        [orjson.dumps(chat_parts(image("http://images.example/cat.png")))], 1
    )
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    LineValidator(allowed, CATALOG.get).check_lines([orjson.dumps(response(input=[item]))], 1)
    # Still no other scheme, and still a host.
    for url, words in (("ftp://x/y.png", "http:// URL"), ("http:///nohost", "host")):
        with pytest.raises(LineError) as info:
            LineValidator(allowed, CATALOG.get).check_lines(
                [orjson.dumps(chat_parts(image(url)))], 1
            )
        assert words in info.value.message


@pytest.mark.parametrize("url", ["http://10.0.0.5/x.png", "http:\\/\\/10.0.0.5/x.png"])
def test_http_images_are_found_whatever_the_settings_say_now(url: str) -> None:
    # A line uploaded while plain http was allowed is fetched (or refused) by Backfill when
    # it runs; its URL never reaches an engine.
    line = orjson.dumps(chat_parts(image("PLACEHOLDER"))).replace(b"PLACEHOLDER", url.encode())
    assert may_hold_remote_images(line)
    assert remote_image_urls(request_body(line)) == ["http://10.0.0.5/x.png"]


# ---- the first bytes of a fetched image (the 2026-12-05 review, Info) ----------------------

SIGNED = {
    "image/png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
    "image/jpeg": b"\xff\xd8\xff\xe0\0\x10JFIF\0",
    "image/gif": b"GIF89a\x01\0\x01\0",
    "image/webp": b"RIFF\x24\0\0\0WEBPVP8 ",
}


def test_every_image_type_has_a_signature_that_its_bytes_match() -> None:
    assert set(SIGNED) == IMAGE_TYPES
    for content_type, data in SIGNED.items():
        assert has_signature(content_type, data)
    assert has_signature("image/gif", b"GIF87a\x01\0")


@pytest.mark.parametrize(
    "data",
    [
        b"<!doctype html><html></html>",
        b"\x1f\x8b\x08\0\0\0\0\0\0\x03",  # gzip, sent without Content-Encoding
        b"",
        b"RIFF\x24\0\0\0WAVEfmt ",
    ],
)
def test_bytes_of_another_kind_do_not_pass_as_any_image(data: bytes) -> None:
    assert not any(has_signature(content_type, data) for content_type in IMAGE_TYPES)
