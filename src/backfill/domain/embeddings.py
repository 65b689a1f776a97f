"""An embeddings answer in the shape its request asked for (``dimensions``,
``encoding_format``), whatever the engine did with those fields.

Some OpenAI-compatible servers (llama.cpp's among them) ignore both and answer full-length
float lists. Backfill accepted the fields, so it honours them: a longer vector is cut to
``dimensions`` and scaled back to unit length (what OpenAI does for its shortened embeddings),
and a float list becomes base64 of little-endian float32 when base64 was asked for. An engine
that honoured them already is left alone.
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class Requested:
    dimensions: int | None = None
    base64: bool = False


def requested(body: dict[str, Any]) -> Requested:
    """What a validated embeddings body (its fields as ``msgspec.Raw``) asks of the answer."""
    dimensions = body.get("dimensions")
    encoding = body.get("encoding_format")
    return Requested(
        msgspec.json.decode(dimensions, type=int) if dimensions is not None else None,
        encoding is not None and msgspec.json.decode(encoding) == "base64",
    )


def conform(answer: Any, wanted: Requested) -> None:
    """Reshape the vectors of an embeddings answer in place."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return
    for item in data:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(vector, list) or not all(isinstance(v, int | float) for v in vector):
            continue
        if wanted.dimensions is not None and len(vector) > wanted.dimensions:
            vector = vector[: wanted.dimensions]
            norm = math.sqrt(sum(v * v for v in vector))
            if norm > 0:
                vector = [v / norm for v in vector]
        if wanted.base64:
            item["embedding"] = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        else:
            item["embedding"] = vector
