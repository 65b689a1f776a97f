"""``/openapi.json`` describes every public route with its request body and its answers.

That real answers conform to these schemas is checked by ``test_schemathesis.py``, which
generates its cases from this same document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
from fastapi.routing import APIRoute
from openapi_spec_validator import validate
from starlette.routing import BaseRoute

from backfill.adapters.http import openapi, wire
from tests.support import InProcess, chat_line, jsonl

BODY_METHODS = {"post", "put", "patch"}
# Operations that take no body: the action is the URL.
NO_BODY = {
    ("post", "/v1/batches/{batch_id}/cancel"),
    ("post", "/v1/batches/{batch_id}/pause"),
    ("post", "/v1/batches/{batch_id}/resume"),
}


def api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """Every API route, looking into included routers (FastAPI keeps them nested)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        nested = getattr(route, "original_router", None)
        if nested is not None:
            yield from api_routes(nested.routes)


async def document(backfill: InProcess) -> dict[str, Any]:
    response = await backfill.client.get("/openapi.json")
    assert response.status_code == 200, response.text
    spec: dict[str, Any] = response.json()
    return spec


async def test_the_document_is_valid_openapi(backfill: InProcess) -> None:
    spec = await document(backfill)
    validate(spec)
    assert spec["openapi"].startswith("3.1")


async def test_every_public_route_is_described(backfill: InProcess) -> None:
    spec = await document(backfill)
    # ``path_format``: the path without converters, as OpenAPI writes it (``{model:path}``,
    # which lets a model id hold slashes, is ``{model}``).
    routes = {
        (method.lower(), route.path_format)
        for route in api_routes(backfill.backfill.app().routes)
        if route.include_in_schema
        for method in route.methods or ()
    }
    described = {(method, path) for path, ops in spec["paths"].items() for method in ops}
    assert routes == described
    assert all(path.startswith("/v1/") for _, path in described), described


async def test_every_operation_has_answers_and_bodies(backfill: InProcess) -> None:
    spec = await document(backfill)
    schemas = spec["components"]["schemas"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            label = f"{method.upper()} {path}"
            responses = operation["responses"]
            assert "422" not in responses, label
            success = [code for code in responses if code.startswith("2")]
            assert success, label
            if method == "head":
                continue
            assert responses["default"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }, label
            for code in success:
                content = responses[code]["content"]
                assert len(content) == 1, label
                (media_type, media) = next(iter(content.items()))
                if media_type == "application/json":
                    assert media.get("schema"), f"{label}: describe it in adapters/http/openapi.py"
            if method in BODY_METHODS and (method, path) not in NO_BODY:
                assert "requestBody" in operation, label
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs <= set(schemas), refs - set(schemas)


async def test_required_fields_are_what_the_api_answers(backfill: InProcess) -> None:
    """Schemathesis checks every answer; this pins the two objects SDKs parse most."""
    schemas = (await document(backfill))["components"]["schemas"]
    uploaded = await backfill.upload(jsonl([chat_line("a", "hello")]))
    assert uploaded.status_code == 200, uploaded.text
    created = await backfill.client.post(
        "/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions"},
    )
    assert created.status_code == 200, created.text
    assert set(schemas["File"]["required"]) == set(uploaded.json())
    assert set(schemas["Batch"]["required"]) == set(created.json())
    # The Structs the schemas come from read the answers back, values and all.
    msgspec.json.decode(uploaded.content, type=wire.File)
    msgspec.json.decode(created.content, type=wire.Batch)


async def test_every_schema_is_generated_from_the_wire_types(backfill: InProcess) -> None:
    """No schema is written by hand: each component is msgspec's, from ``wire.py``."""
    schemas = (await document(backfill))["components"]["schemas"]
    assert schemas == openapi.schemas()
