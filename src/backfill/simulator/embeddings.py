"""``POST /v1/embeddings`` of the simulated engine: the request it accepts, the vectors it
returns.

A vector is a pure function of its input: SHAKE-256 of the input (its text, or its token ids)
stretched to ``dimensions`` numbers in [-1, 1), then L2-normalised. The same input always gets
the same vector, two different inputs (almost surely) different ones, and asking for fewer
``dimensions`` truncates the full vector before normalising, as OpenAI's shortened embeddings
do. Every number is rounded to float32 first, so ``encoding_format: base64`` (little-endian
float32 bytes, as OpenAI sends them) decodes to exactly the floats of ``float``.

Each input is one prefill-only sequence for the timing model; its prompt tokens are its words
(a string) or its token ids (a list of integers).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

from backfill.simulator import fields
from backfill.simulator.fields import BadRequest

FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "priority")
MAX_INPUTS = 2048
"""OpenAI's limit of inputs in one request."""


@dataclass(frozen=True)
class EmbeddingAsk:
    model: str
    inputs: list[list[str]]
    """The prompt tokens of each input, in order."""
    keys: list[bytes]
    """What each input's vector is derived from."""
    text: str
    """The string inputs joined by newlines: where fault directives are looked for."""
    dimensions: int
    base64: bool
    priority: int


def parse(body: dict[str, Any], max_dimensions: int) -> EmbeddingAsk:
    fields.only_known(body, FIELDS)
    model = fields.model(body)
    fields.optional_string(body, "user")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format", "encoding_format must be float or base64")
    dimensions = body.get("dimensions", max_dimensions)
    if not fields.is_int(dimensions) or not 1 <= dimensions <= max_dimensions:
        raise BadRequest("dimensions", f"dimensions must be an integer from 1 to {max_dimensions}")
    inputs, keys, texts = _inputs(body.get("input"))
    return EmbeddingAsk(
        model=model,
        inputs=inputs,
        keys=keys,
        text="\n".join(texts),
        dimensions=dimensions,
        base64=encoding == "base64",
        priority=fields.priority(body),
    )


def vector(key: bytes, full: int, dimensions: int) -> list[float]:
    """The first ``dimensions`` of ``key``'s ``full``-sized vector, L2-normalised, float32."""
    raw = struct.unpack(f"<{full}I", hashlib.shake_256(key).digest(4 * full))
    values = [word / 2**31 - 1.0 for word in raw[:dimensions]]
    norm = math.hypot(*values) or 1.0
    packed = struct.pack(f"<{dimensions}f", *(value / norm for value in values))
    return list(struct.unpack(f"<{dimensions}f", packed))


def reply(ask: EmbeddingAsk, vectors: list[list[float]]) -> dict[str, Any]:
    prompt_tokens = sum(max(1, len(tokens)) for tokens in ask.inputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": _encode(values, ask.base64)}
            for index, values in enumerate(vectors)
        ],
        "model": ask.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encode(values: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _inputs(value: object) -> tuple[list[list[str]], list[bytes], list[str]]:
    """(tokens, vector keys, texts) of OpenAI's four input shapes: a string, a list of
    strings, a list of token ids, a list of lists of token ids."""
    if isinstance(value, str):
        return _strings([value])
    if not isinstance(value, list) or not value:
        raise BadRequest("input", "input must be a string or a non-empty list")
    if len(value) > MAX_INPUTS:
        raise BadRequest("input", f"input must have at most {MAX_INPUTS} items")
    if all(isinstance(item, str) for item in value):
        return _strings(value)
    if all(fields.is_int(item) for item in value):
        return _token_lists([value])
    if all(isinstance(item, list) for item in value):
        return _token_lists(value)
    raise BadRequest(
        "input", "input must be a string, strings, token ids or lists of token ids, not a mix"
    )


def _strings(texts: list[str]) -> tuple[list[list[str]], list[bytes], list[str]]:
    for index, text in enumerate(texts):
        if not text:
            raise BadRequest(f"input[{index}]", "an input must not be empty")
    keys = [b"text\0" + text.encode() for text in texts]
    return [text.split() for text in texts], keys, texts


def _token_lists(lists: list[Any]) -> tuple[list[list[str]], list[bytes], list[str]]:
    tokens: list[list[str]] = []
    for index, ids in enumerate(lists):
        if not ids or not all(fields.is_int(i) and i >= 0 for i in ids):
            raise BadRequest(
                f"input[{index}]", "a token list must hold non-negative integers and not be empty"
            )
        tokens.append([str(i) for i in ids])
    keys = [b"ids\0" + ",".join(ids).encode() for ids in tokens]
    return tokens, keys, []
