"""Embeddings answers take the shape their request asked for (``domain/embeddings.py``)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import orjson

from backfill.domain.embeddings import Requested, conform, requested
from backfill.domain.input_format import request_body


def answer(*vectors: Any) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data}


def body(**fields: Any) -> dict[str, Any]:
    line = {"body": {"model": "m", "input": "x", **fields}}
    return request_body(orjson.dumps(line))


def test_what_a_body_asks() -> None:
    assert requested(body()) == Requested(None, base64=False)
    assert requested(body(dimensions=3, encoding_format="base64")) == Requested(3, base64=True)
    assert requested(body(encoding_format="float")) == Requested(None, base64=False)


def test_longer_vectors_are_cut_and_made_unit_length() -> None:
    out = answer([3.0, 4.0, 12.0], [1.0, 0.0])
    conform(out, Requested(2))
    assert out["data"][0]["embedding"] == [0.6, 0.8]
    assert out["data"][1]["embedding"] == [1.0, 0.0]


def test_base64_is_little_endian_float32() -> None:
    out = answer([0.5, -2.0, 1.0])
    conform(out, Requested(2, base64=True))
    packed = base64.b64decode(out["data"][0]["embedding"])
    values = struct.unpack("<2f", packed)
    assert math.isclose(values[0], 0.5 / math.sqrt(4.25), rel_tol=1e-6)
    assert math.isclose(values[1], -2.0 / math.sqrt(4.25), rel_tol=1e-6)


def test_answers_already_in_shape_or_unexpected_are_left_alone() -> None:
    encoded = answer("AAAAPw==")
    conform(encoded, Requested(1, base64=True))
    assert encoded["data"][0]["embedding"] == "AAAAPw=="
    odd: Any
    for odd in ({"error": "x"}, [], {"data": "x"}, {"data": [{"embedding": [1, "a"]}]}):
        conform(odd, Requested(1, base64=True))
