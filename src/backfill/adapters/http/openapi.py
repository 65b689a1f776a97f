"""``/openapi.json``: every public route with its request body and its responses (SPEC §11.6).

The routes read their bodies raw (streamed multipart, msgspec-decoded JSON) and answer with
prebuilt JSON, so FastAPI can infer neither side. The objects are written here once, as
JSON Schema, and attached to the generated document by operation. ``tests`` check that every
public operation is covered, that the document is valid OpenAPI, and (with schemathesis) that
real answers conform to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from backfill.adapters.http.requests import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
)
from backfill.domain.endpoints import ENDPOINTS
from backfill.domain.files import MAX_EXPIRY_S, MIN_EXPIRY_S
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.progress import MAX_POINTS

Schema = dict[str, Any]

JSON = "application/json"
JSONL = "application/jsonl"


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: Schema, *, optional: tuple[str, ...] = ()) -> Schema:
    """An object with every property required except ``optional``; more keys may come."""
    return {
        "type": "object",
        "required": [name for name in properties if name not in optional],
        "properties": properties,
    }


INT = {"type": "integer"}
COUNT = {"type": "integer", "minimum": 0}
STR = {"type": "string"}
NULLABLE_INT = nullable(INT)
NULLABLE_STR = nullable(STR)
METADATA = nullable(
    {
        "type": "object",
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        "description": f"Up to {MAX_METADATA_PAIRS} string pairs, keys up to "
        f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}.",
    }
)
PRICING = nullable(
    obj({"unit": STR, "input": STR, "cached_input": STR, "output": STR})
    | {"description": "Prices per token, as decimal strings in 'unit'."}
)
EXPIRES_AFTER = obj(
    {
        "anchor": {"const": "created_at"},
        "seconds": {"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S},
    }
) | {"additionalProperties": False}
TIMESTAMPS = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

SCHEMAS: dict[str, Schema] = {
    "Error": obj(
        {
            "error": obj(
                {
                    "message": {"type": "string", "minLength": 1},
                    "type": STR,
                    "param": NULLABLE_STR,
                    "code": NULLABLE_STR,
                    "line": {
                        "type": "integer",
                        "minimum": 1,
                        "description": "The input line at fault, for file validation errors.",
                    },
                },
                optional=("line",),
            )
        }
    )
    | {"additionalProperties": False, "description": "The OpenAI error envelope."},
    "File": obj(
        {
            "id": STR,
            "object": {"const": "file"},
            "bytes": COUNT,
            "created_at": INT,
            "expires_at": NULLABLE_INT,
            "filename": STR,
            "purpose": {"enum": ["batch", "batch_output"]},
            "status": {"enum": ["processed", "uploaded", "deleted"]},
            "status_details": {"type": "null"},
        }
    ),
    "FileDeleted": obj({"id": STR, "object": {"const": "file"}, "deleted": {"const": True}}),
    "Batch": obj(
        {
            "id": STR,
            "object": {"const": "batch"},
            "endpoint": {"enum": sorted(ENDPOINTS)},
            "model": NULLABLE_STR,
            "input_file_id": STR,
            "completion_window": STR,
            "status": {"enum": [status.value for status in BatchStatus]},
            "output_file_id": NULLABLE_STR,
            "error_file_id": NULLABLE_STR,
            "created_at": INT,
            **dict.fromkeys(TIMESTAMPS, NULLABLE_INT),
            "request_counts": obj({"total": COUNT, "completed": COUNT, "failed": COUNT}),
            "errors": nullable(
                obj(
                    {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": obj(
                                {
                                    "code": STR,
                                    "message": STR,
                                    "param": NULLABLE_STR,
                                    "line": NULLABLE_INT,
                                },
                                optional=("param", "line"),
                            ),
                        },
                    }
                )
            ),
            "metadata": METADATA,
            "usage": obj(
                {
                    "input_tokens": COUNT,
                    "input_tokens_details": obj({"cached_tokens": COUNT}),
                    "output_tokens": COUNT,
                    "output_tokens_details": obj({"reasoning_tokens": COUNT}),
                    "total_tokens": COUNT,
                }
            ),
            "model_config_id": NULLABLE_STR,
            "billing": {"enum": ["catalog", "gpu_time"]},
            "pricing": PRICING,
            "webhook_url": NULLABLE_STR,
            "retry_of": NULLABLE_STR
            | {"description": "The batch whose unsucceeded lines this one reruns."},
            "estimated_completion_at": NULLABLE_INT,
            "waiting_on": nullable(
                obj({"code": {"enum": ["no_healthy_engine"]}, "message": STR, "since": INT})
                | {"description": "Why the batch makes no progress now, until it resumes."}
            ),
        }
    ),
    "BatchDeleted": obj(
        {"id": STR, "object": {"const": "batch.deleted"}, "deleted": {"const": True}}
    ),
    "BatchNotification": obj(
        {
            "id": STR,
            "object": {"const": "batch.notification"},
            "batch_id": STR,
            "channel": {"enum": ["webhook", "endpoint", "email"]},
            "event": STR,
            "target": STR,
            "endpoint_id": NULLABLE_STR,
            "status": {"enum": ["pending", "delivered", "failed"]},
            "attempts": COUNT,
            "last_status_code": NULLABLE_INT,
            "last_error": NULLABLE_STR,
            "last_attempt_at": NULLABLE_INT,
            "next_attempt_at": NULLABLE_INT,
            "delivered_at": NULLABLE_INT,
            "created_at": INT,
        }
    ),
    "Model": obj(
        {
            "id": STR,
            "object": {"const": "model"},
            "created": INT,
            "owned_by": STR,
            "model_config_id": NULLABLE_STR,
            "context_length": COUNT,
            "max_output_tokens": COUNT,
            "modalities": {"type": "array", "items": STR},
            "batch": nullable(
                obj(
                    {
                        "modalities": {"type": "array", "items": STR},
                        "endpoints": {"type": "array", "items": STR},
                        "billing": {"enum": ["catalog", "gpu_time"]},
                        "pricing": PRICING,
                    }
                )
            ),
        }
    ),
    "Receipt": obj(
        {
            "object": {"const": "receipt"},
            "request_id": STR,
            "kind": STR,
            "batch_id": NULLABLE_STR,
            "custom_id": NULLABLE_STR,
            "model_config_id": NULLABLE_STR,
            "deployment_id": NULLABLE_STR,
            "usage": obj(
                {
                    "input_tokens": COUNT,
                    "input_tokens_details": obj({"cached_tokens": COUNT}),
                    "output_tokens": COUNT,
                    "total_tokens": COUNT,
                }
            ),
            "pricing": PRICING,
            "gpu_count": NULLABLE_INT,
            "gpu_ms": NULLABLE_INT,
            "amount": obj(
                {"unit": {"const": "picousd"}, "value": STR, "usd": STR},
            ),
            "started_at": nullable({"type": "number"}),
            "created_at": {"type": "number"},
        }
    ),
    "CreateBatchRequest": obj(
        {
            "input_file_id": STR,
            "endpoint": {"enum": sorted(ENDPOINTS)},
            "completion_window": STR
            | {"default": "24h", "description": "A duration such as '24h', '48h' or '7d'."},
            "metadata": METADATA,
            "webhook_url": NULLABLE_STR
            | {"description": "An HTTPS URL on a public host, told when the batch ends."},
            "output_expires_after": nullable(EXPIRES_AFTER),
        },
        optional=("completion_window", "metadata", "webhook_url", "output_expires_after"),
    )
    | {"additionalProperties": False},
    "RetryBatchRequest": obj(
        {
            "completion_window": STR,
            "metadata": METADATA,
            "output_expires_after": nullable(EXPIRES_AFTER),
        },
        optional=("completion_window", "metadata", "output_expires_after"),
    )
    | {
        "additionalProperties": False,
        "description": "Every field is optional; one left out is taken from the batch rerun.",
    },
    "UploadForm": obj(
        {
            "purpose": {"const": "batch"},
            "file": {"type": "string", "format": "binary"},
            "expires_after[anchor]": {"const": "created_at"},
            "expires_after[seconds]": {"type": "string", "pattern": "^[0-9]+$"},
        },
        optional=("expires_after[anchor]", "expires_after[seconds]"),
    ),
}


def list_of(item: str) -> Schema:
    return obj(
        {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref(item)},
            "first_id": NULLABLE_STR,
            "last_id": NULLABLE_STR,
            "has_more": {"type": "boolean"},
        }
    )


def body(media_type: str, schema: Schema, *, required: bool = True) -> Schema:
    return {"required": required, "content": {media_type: {"schema": schema}}}


def answer(description: str, media_type: str = JSON, schema: Schema | None = None) -> Schema:
    content: Schema = {} if schema is None else {"schema": schema}
    return {"description": description, "content": {media_type: content}}


class Operation:
    """What FastAPI cannot see of one operation: its body and its successful answers."""

    def __init__(self, responses: dict[str, Schema], request_body: Schema | None = None) -> None:
        self.responses = responses
        self.request_body = request_body


def ok(schema: Schema, description: str = "Success") -> dict[str, Schema]:
    return {"200": answer(description, JSON, schema)}


CONTENT = {
    "200": answer("The file's bytes", JSONL),
    "206": answer("The requested range of the bytes", JSONL),
    "304": {"description": "Not modified: the ETag in If-None-Match still matches."},
    "416": answer("The range starts past the end", JSON, ref("Error")),
}
UNDESCRIBED = {"200": answer("Success")}
HEADERS_ONLY = {"200": {"description": "The headers of the GET, without the bytes"}}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/files"): Operation(
        ok(ref("File")), body("multipart/form-data", ref("UploadForm"))
    ),
    ("get", "/v1/files"): Operation(ok(list_of("File"))),
    ("get", "/v1/files/{file_id}"): Operation(ok(ref("File"))),
    ("delete", "/v1/files/{file_id}"): Operation(ok(ref("FileDeleted"))),
    ("get", "/v1/files/{file_id}/content"): Operation(CONTENT),
    ("head", "/v1/files/{file_id}/content"): Operation(HEADERS_ONLY),
    ("post", "/v1/batches"): Operation(ok(ref("Batch")), body(JSON, ref("CreateBatchRequest"))),
    ("get", "/v1/batches"): Operation(ok(list_of("Batch"))),
    ("get", "/v1/batches/{batch_id}"): Operation(ok(ref("Batch"))),
    ("delete", "/v1/batches/{batch_id}"): Operation(ok(ref("BatchDeleted"))),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation(ok(ref("Batch"))),
    ("post", "/v1/batches/{batch_id}/retry"): Operation(
        ok(ref("Batch"), "The new batch"),
        body(JSON, ref("RetryBatchRequest"), required=False),
    ),
    ("get", "/v1/batches/{batch_id}/notifications"): Operation(ok(list_of("BatchNotification"))),
    ("get", "/v1/batches/{batch_id}/results"): Operation(
        {"200": answer("Output and error rows stored so far, one JSON object per line", JSONL)}
    ),
    ("get", "/v1/models"): Operation(ok(list_of("Model"))),
    ("get", "/v1/receipts/{request_id}"): Operation(ok(ref("Receipt"))),
}

# The key's own identity, its org's credit and ledger, charges and error codes per batch
# (adapters/http/account.py; the Batches page reads them).
MONEY = obj({"unit": {"const": "picousd"}, "value": STR, "usd": STR})
USD = {"type": "string", "description": "An exact decimal amount of USD."}
SCHEMAS |= {
    "ApiKey": obj(
        {
            "id": STR,
            "object": {"const": "api_key"},
            "name": NULLABLE_STR,
            "prefix": STR,
            "scopes": {"type": "array", "items": STR},
            "created_at": INT,
            "organization": obj({"id": STR, "name": STR}),
        }
    ),
    "Organization": obj(
        {
            "id": STR,
            "object": {"const": "organization"},
            "name": STR,
            "created_at": INT,
            "credit": obj(
                {
                    "unit": {"const": "usd"},
                    "credits": USD,
                    "charges": USD,
                    "balance": USD,
                    "reserved": USD,
                    "available": USD,
                }
            ),
        }
    ),
    "LedgerEntry": obj(
        {
            "id": STR,
            "object": {"const": "ledger_entry"},
            "type": {"enum": ["credit", "batch"]},
            "created_at": INT,
            "amount": MONEY,
            "note": NULLABLE_STR,
            "batch_id": NULLABLE_STR,
            "batch_status": NULLABLE_STR,
            "model": NULLABLE_STR,
            "reserved": nullable(MONEY),
        }
    ),
    "BatchCharges": obj(
        {
            "id": STR,
            "object": {"const": "batch.charges"},
            "status": {"enum": [status.value for status in BatchStatus]},
            "billing": {"enum": ["catalog", "gpu_time"]},
            "charged": MONEY,
            "reserved": MONEY,
        }
    ),
    "BatchErrorCodes": obj(
        {
            "object": {"const": "batch.error_codes"},
            "batch_id": STR,
            "data": {
                "type": "array",
                "items": obj({"code": STR, "count": {"type": "integer", "minimum": 1}}),
            },
            "rows_read": COUNT,
            "truncated": {"type": "boolean"},
            "complete": {"type": "boolean"},
        }
    ),
}
OPERATIONS |= {
    ("get", "/v1/api_key"): Operation(ok(ref("ApiKey"))),
    ("get", "/v1/organization"): Operation(ok(ref("Organization"))),
    ("get", "/v1/organization/ledger"): Operation(ok(list_of("LedgerEntry"))),
    ("get", "/v1/organization/batch_charges"): Operation(ok(list_of("BatchCharges"))),
    ("get", "/v1/batches/{batch_id}/error_codes"): Operation(ok(ref("BatchErrorCodes"))),
}

# A batch's results over time, from when each was stored (adapters/http/progress_routes.py).
SCHEMAS |= {
    "BatchProgress": obj(
        {
            "object": {"const": "batch.progress"},
            "batch_id": STR,
            "total": COUNT,
            "points": {
                "type": "array",
                "maxItems": MAX_POINTS,
                "description": "By 'done', increasing; empty while no result is stored and for "
                "results stored before their times were kept.",
                "items": obj(
                    {
                        "at": {"type": "number", "description": "Unix seconds."},
                        "done": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "Results stored (completed and failed) by 'at'.",
                        },
                    }
                ),
            },
        }
    ),
}
OPERATIONS |= {
    ("get", "/v1/batches/{batch_id}/progress"): Operation(ok(ref("BatchProgress"))),
}

ERROR_ANSWER = answer(
    "An error, in the OpenAI envelope. 'x-should-retry' says whether a retry can help.",
    JSON,
    ref("Error"),
)


def completed(spec: Schema, operations: dict[tuple[str, str], Operation]) -> Schema:
    """The generated document with each operation's body and answers from ``operations``."""
    for path, methods in spec.get("paths", {}).items():
        for method, operation in methods.items():
            # A route not listed keeps an answer without a schema; tests/integration/
            # test_openapi.py fails on it, and the document is still served.
            known = operations.get((method, path), Operation(UNDESCRIBED))
            # The routes never answer 422: FastAPI's validation error is mapped to the envelope.
            responses: Schema = dict(known.responses)
            if method != "head":
                responses["default"] = ERROR_ANSWER
            operation["responses"] = responses
            if known.request_body is not None:
                operation["requestBody"] = known.request_body
    components = spec.setdefault("components", {})
    generated = components.get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        generated.pop(unused, None)
    components["schemas"] = {**generated, **SCHEMAS}
    return spec


def document(app: FastAPI) -> Callable[[], Schema]:
    """The completed document of ``app``, built on first use (every router is in by then)."""
    built: list[Schema] = []

    def openapi() -> Schema:
        if not built:
            spec = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            built.append(completed(spec, OPERATIONS))
        return built[0]

    return openapi
