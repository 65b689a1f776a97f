"""Schemathesis against the public API (SPEC §3, §4, §4.7, §11.6, §12).

The app's ``/openapi.json`` lists every public operation but declares no response schemas
(``{}``), only a 422 error the API never sends, and no request bodies for ``POST /v1/files`` and
``POST /v1/batches`` (both read the raw request). So the test loads that document from a real
``backfill up`` over HTTP and completes it from the SPEC before generating cases:

- request bodies: the multipart upload form and the JSON batch creation body;
- path parameters: real file and batch IDs as well as arbitrary strings;
- responses: File, Batch, list envelope, deleted marker, and the OpenAI error envelope as
  ``default``.

Every operation then gets positive and negative (schema-violating) cases with the default
org's key. Checks: ``not_a_server_error`` (no 5xx), ``response_schema_conformance`` (against
the schemas above), and: every response carries ``x-request-id``; every error is an OpenAI
envelope; every non-retryable 4xx says ``x-should-retry: false``.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.core.result import Err, Ok

from tests.support import ServerProcess, chat_line, jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

EXAMPLES_PER_MODE = 75

NULLABLE_INT = {"type": ["integer", "null"]}
NULLABLE_STR = {"type": ["string", "null"]}
ERROR = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": NULLABLE_STR,
                "code": NULLABLE_STR,
                "line": {"type": "integer", "minimum": 1},
            },
        }
    },
}
FILE = {
    "type": "object",
    "required": [
        "id",
        "object",
        "bytes",
        "created_at",
        "expires_at",
        "filename",
        "purpose",
        "status",
        "status_details",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer", "minimum": 0},
        "created_at": {"type": "integer"},
        "expires_at": NULLABLE_INT,
        "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]},
        "status": {"enum": ["processed", "uploaded", "deleted"]},
        "status_details": {"type": "null"},
    },
}
BATCH_TIMESTAMPS = [
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
]
BATCH = {
    "type": "object",
    "required": [
        "id",
        "object",
        "endpoint",
        "model",
        "input_file_id",
        "completion_window",
        "status",
        "output_file_id",
        "error_file_id",
        "created_at",
        *BATCH_TIMESTAMPS,
        "request_counts",
        "errors",
        "metadata",
        "usage",
        "estimated_completion_at",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
        "input_file_id": {"type": "string"},
        "completion_window": {"type": "string"},
        "status": {
            "enum": [
                "validating",
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            ]
        },
        "output_file_id": NULLABLE_STR,
        "error_file_id": NULLABLE_STR,
        "created_at": {"type": "integer"},
        **dict.fromkeys(BATCH_TIMESTAMPS, NULLABLE_INT),
        "request_counts": {
            "type": "object",
            "required": ["total", "completed", "failed"],
            "properties": {
                "total": {"type": "integer", "minimum": 0},
                "completed": {"type": "integer", "minimum": 0},
                "failed": {"type": "integer", "minimum": 0},
            },
        },
        "errors": {"type": ["object", "null"]},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "usage": {"type": ["object", "null"]},
        "estimated_completion_at": NULLABLE_INT,
    },
}


def list_of(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "first_id", "last_id", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "first_id": NULLABLE_STR,
            "last_id": NULLABLE_STR,
            "has_more": {"type": "boolean"},
        },
    }


DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"object": {"const": "file"}, "deleted": {"const": True}},
}
BATCH_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"object": {"const": "batch.deleted"}, "deleted": {"const": True}},
}
NOTIFICATION = {
    "type": "object",
    "required": ["id", "object", "batch_id", "channel", "event", "status", "attempts"],
    "properties": {
        "object": {"const": "batch.notification"},
        "channel": {"enum": ["webhook", "endpoint", "email"]},
        "status": {"enum": ["pending", "delivered", "failed"]},
        "attempts": {"type": "integer", "minimum": 0},
        "last_status_code": NULLABLE_INT,
        "next_attempt_at": NULLABLE_INT,
        "delivered_at": NULLABLE_INT,
    },
}
OK_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/files"): FILE,
    ("get", "/v1/files"): list_of(FILE),
    ("get", "/v1/files/{file_id}"): FILE,
    ("delete", "/v1/files/{file_id}"): DELETED,
    ("post", "/v1/batches"): BATCH,
    ("get", "/v1/batches"): list_of(BATCH),
    ("get", "/v1/batches/{batch_id}"): BATCH,
    ("post", "/v1/batches/{batch_id}/cancel"): BATCH,
    ("post", "/v1/batches/{batch_id}/retry"): BATCH,
    ("delete", "/v1/batches/{batch_id}"): BATCH_DELETED,
    ("get", "/v1/batches/{batch_id}/notifications"): list_of(NOTIFICATION),
    ("get", "/v1/models"): list_of({"type": "object", "required": ["id"]}),
    ("get", "/v1/receipts/{request_id}"): {"type": "object"},
}


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def completed_spec(
    spec: dict[str, Any], file_ids: list[str], batch_ids: list[str]
) -> dict[str, Any]:
    """The app's document plus what the SPEC says about bodies, IDs and responses."""
    spec = copy.deepcopy(spec)
    ids = {"file_id": file_ids, "batch_id": batch_ids}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                known = ids.get(parameter["name"])
                if parameter["in"] == "path" and known:
                    parameter["schema"] = {"anyOf": [{"enum": known}, {"type": "string"}]}
            responses: dict[str, Any] = {"default": json_response(ERROR, "An OpenAI error")}
            if method == "head":
                # A HEAD answer has the headers of the GET and never a body, errors included.
                operation["responses"] = {"default": {"description": "Headers only"}}
                continue
            if path == "/v1/files/{file_id}/content":
                jsonl_body: dict[str, Any] = {"content": {"application/jsonl": {}}}
                responses["200"] = {"description": "The bytes", **jsonl_body}
                responses["206"] = {"description": "A range of the bytes", **jsonl_body}
                responses["304"] = {"description": "Not modified"}
                responses["416"] = json_response(ERROR, "The range starts past the end")
            elif path == "/v1/batches/{batch_id}/results":
                responses["200"] = {
                    "description": "Rows stored so far",
                    "content": {"application/jsonl": {}},
                }
            else:
                responses["200"] = json_response(OK_SCHEMAS[(method, path)], "Success")
            operation["responses"] = responses
    spec["paths"]["/v1/files"]["post"]["requestBody"] = {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["purpose", "file"],
                    "properties": {
                        "purpose": {"anyOf": [{"const": "batch"}, {"type": "string"}]},
                        "file": {"type": "string", "format": "binary"},
                        "expires_after[anchor]": {"type": "string"},
                        "expires_after[seconds]": {"type": "string"},
                    },
                }
            }
        },
    }
    spec["paths"]["/v1/batches"]["post"]["requestBody"] = {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["input_file_id", "endpoint", "completion_window"],
                    "properties": {
                        "input_file_id": {"anyOf": [{"enum": file_ids}, {"type": "string"}]},
                        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
                        "completion_window": {
                            "anyOf": [{"enum": ["24h", "48h", "7d"]}, {"type": "string"}]
                        },
                        "metadata": {
                            "type": ["object", "null"],
                            "additionalProperties": {"type": "string"},
                        },
                        "webhook_url": {"type": "string"},
                        "output_expires_after": {"type": "object"},
                    },
                }
            }
        },
    }
    return spec


def header(response: schemathesis.Response, name: str) -> str | None:
    """Schemathesis keeps every header as a list of values."""
    values = response.headers.get(name)
    return values[0] if values else None


def check_headers_and_envelope(response: schemathesis.Response) -> None:
    status = response.status_code
    assert header(response, "x-request-id"), f"{status} without x-request-id"
    if status < 400:
        return
    if response.request.method == "HEAD":
        # No body to hold the envelope; the headers still say whether to retry.
        assert header(response, "x-should-retry") in ("true", "false"), status
        return
    body = response.json()
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    if status < 500 and status != 429:
        assert header(response, "x-should-retry") == "false", (status, body)


def seed_objects(server: ServerProcess) -> tuple[list[str], list[str]]:
    """Real files and batches for the generated cases to find, change and delete."""
    file_ids: list[str] = []
    with server.client() as client:
        for n in range(3):
            rows = [chat_line(f"seed-{n}-{i}", f"question {i}") for i in range(3)]
            uploaded = client.post(
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
            )
            assert uploaded.status_code == 200, uploaded.text
            file_ids.append(uploaded.json()["id"])
        batch_ids = []
        for file_id in file_ids[:2]:
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            assert created.status_code == 200, created.text
            batch_ids.append(created.json()["id"])
    return file_ids, batch_ids


def test_every_operation_answers_without_server_errors(server_process: ServerProcess) -> None:
    base_url = f"http://127.0.0.1:{server_process.port}"
    file_ids, batch_ids = seed_objects(server_process)
    spec = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(completed_spec(spec, file_ids, batch_ids))
    auth = {"Authorization": f"Bearer {server_process.key}"}
    statuses: Counter[int] = Counter()
    unsatisfiable: list[str] = []
    failures: list[str] = []
    results = list(schema.get_all_operations())
    broken = [r.err() for r in results if isinstance(r, Err)]
    assert not broken, broken
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert len(operations) >= 11, [op.label for op in operations]

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(mode))
            def run(case: Any) -> None:
                response = case.call(base_url=base_url, headers=auth, timeout=30)
                statuses[response.status_code] += 1
                case.validate_response(
                    response, checks=[not_a_server_error, response_schema_conformance]
                )
                check_headers_and_envelope(response)

            try:
                run()
            except Unsatisfiable:
                # Nothing to violate (no parameters, no body): no negative cases exist.
                assert mode is GenerationMode.NEGATIVE, operation.label
                unsatisfiable.append(operation.label)
            except (Exception, BaseExceptionGroup) as exc:  # report every failing operation
                failures.append(f"{operation.label} ({mode.value}): {exc}")

    calls = sum(statuses.values())
    print(f"\nschemathesis: {calls} calls, statuses {dict(sorted(statuses.items()))}")
    print(f"no negative cases for: {unsatisfiable}")
    assert not failures, "\n\n".join(failures)
    assert calls >= 10 * len(operations)
    assert statuses[200] > 0, "no case reached a success path"
