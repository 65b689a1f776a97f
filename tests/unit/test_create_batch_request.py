"""The body of POST /v1/batches, decoded at the edge into a CreateBatchRequest (SPEC §4.1)."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from backfill.adapters.http.requests import FIELD_RULES, create_batch_request
from backfill.domain.batch_request import CreateBatchRequest, OutputExpiresAfter
from backfill.errors import InvalidInput

GOOD: dict[str, Any] = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions"}


def refused(body: dict[str, Any] | bytes) -> InvalidInput:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(InvalidInput) as info:
        create_batch_request(raw)
    return info.value


def test_every_field_has_a_rule_that_names_its_refusals() -> None:
    assert sorted(FIELD_RULES) == sorted(CreateBatchRequest.__struct_fields__)


def test_a_minimal_body_takes_the_defaults() -> None:
    request, _ = create_batch_request(orjson.dumps(GOOD))
    assert request == CreateBatchRequest("file-1", "/v1/chat/completions")
    assert request.completion_window == "24h"
    assert (request.metadata, request.webhook_url, request.output_expires_after) == (None,) * 3


def test_a_full_body_is_typed() -> None:
    body = {
        **GOOD,
        "completion_window": "48h",
        "metadata": {"run": "7"},
        "webhook_url": None,
        "output_expires_after": {"anchor": "created_at", "seconds": 7200},
    }
    request, _ = create_batch_request(orjson.dumps(body))
    assert request.metadata == {"run": "7"}
    assert request.output_expires_after == OutputExpiresAfter("created_at", 7200)


def test_the_hash_is_of_the_body_as_sorted_json() -> None:
    """The stored hash of earlier submissions must still match their replays."""
    raw = b'{ "endpoint": "/v1/chat/completions",\n "input_file_id": "file-1", "metadata": {}}'
    _, request_hash = create_batch_request(raw)
    canonical = orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS)
    assert request_hash == hashlib.sha256(canonical).hexdigest()
    reordered = b'{"metadata":{},"input_file_id":"file-1","endpoint":"/v1/chat/completions"}'
    assert create_batch_request(reordered)[1] == request_hash
    assert create_batch_request(orjson.dumps(GOOD))[1] != request_hash


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'"text"', b"null"])
def test_a_body_that_is_not_a_json_object_is_invalid_json(raw: bytes) -> None:
    assert refused(raw).code == "invalid_json"


@pytest.mark.parametrize(
    ("changes", "code", "param"),
    [
        ({"priority": "high"}, "invalid_value", "priority"),
        ({"priority": True}, "invalid_value", "priority"),
        ({"output_validation": "yes"}, "invalid_value", "output_validation"),
        ({"prority": 5}, "unknown_parameter", "prority"),
        ({"": {}}, "unknown_parameter", ""),
        ({"webhook_url": 5}, "invalid_value", "webhook_url"),
        ({"input_file_id": None}, "missing_required_parameter", "input_file_id"),
        ({"input_file_id": ""}, "missing_required_parameter", "input_file_id"),
        ({"input_file_id": 7}, "missing_required_parameter", "input_file_id"),
        ({"endpoint": [["x"]]}, "invalid_value", "endpoint"),
        ({"endpoint": "/v1/images/generations"}, "invalid_value", "endpoint"),
        ({"completion_window": 86400}, "invalid_value", "completion_window"),
        ({"completion_window": None}, "invalid_value", "completion_window"),
        ({"metadata": ["not", "an", "object"]}, "invalid_value", "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "invalid_value", "metadata." + "k" * 65),
        ({"metadata": {"key": "v" * 513}}, "invalid_value", "metadata.key"),
        ({"metadata": {"ok": "v", "key": 5}}, "invalid_value", "metadata.key"),
        ({"metadata": {"key": None}}, "invalid_value", "metadata.key"),
        ({"output_expires_after": 5}, "invalid_value", "output_expires_after"),
        (
            {"output_expires_after": {"anchor": "x", "seconds": 3600}},
            "invalid_value",
            "output_expires_after",
        ),
        ({"output_expires_after": {"seconds": 3600}}, "invalid_value", "output_expires_after"),
        (
            {"output_expires_after": {"anchor": "created_at"}},
            "invalid_value",
            "output_expires_after.seconds",
        ),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": True}},
            "invalid_value",
            "output_expires_after.seconds",
        ),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 3599}},
            "invalid_value",
            "output_expires_after.seconds",
        ),
    ],
)
def test_each_refusal_names_its_field(changes: dict[str, Any], code: str, param: str) -> None:
    body = {**GOOD, **changes}
    if changes.get("input_file_id", "") is None:
        del body["input_file_id"]
    error = refused(body)
    assert (error.code, error.param) == (code, param), error.message
    assert param.split(".")[0] in error.message


def test_nesting_the_encoder_refuses_is_named_before_the_field_rules() -> None:
    deep = b'{"a":' * 255 + b'"leaf"' + b"}" * 255
    error = refused(b'{"input_file_id":"f","endpoint":"/v1/completions","metadata":%s}' % deep)
    assert (error.code, error.param) == ("invalid_value", "metadata")
    assert "254 levels" in error.message


def test_nested_metadata_names_the_key() -> None:
    error = refused({**GOOD, "metadata": {"a": {"b": "c"}}})
    assert error.param == "metadata.a"
    assert "string" in error.message


def test_an_unknown_key_inside_output_expires_after_is_refused_by_name() -> None:
    body = {
        "input_file_id": "file-1",
        "endpoint": "/v1/chat/completions",
        "output_expires_after": {"anchor": "created_at", "seconds": 3600, "extra": 1},
    }
    with pytest.raises(InvalidInput) as caught:
        create_batch_request(orjson.dumps(body))
    assert caught.value.code == "unknown_parameter"
    assert caught.value.param == "output_expires_after.extra"
    assert "'anchor' and 'seconds'" in caught.value.message
