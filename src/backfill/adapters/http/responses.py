"""The JSON answer every route gives: the body encoded once by orjson."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")
