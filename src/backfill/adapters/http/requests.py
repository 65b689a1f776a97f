"""Request bodies decoded into typed requests at the edge; every refusal names its field."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from backfill.domain.batch_request import CreateBatchRequest
from backfill.domain.decode_errors import Broken, DecodeProblem, explain
from backfill.domain.files import MAX_EXPIRY_S, MIN_EXPIRY_S
from backfill.domain.input_format import ENDPOINTS
from backfill.domain.priority import MIN_PRIORITY
from backfill.errors import InvalidInput

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# orjson, which hashes and stores the request, encodes at most this many levels of nesting.
MAX_REQUEST_DEPTH = 254


def create_batch_request(raw: bytes) -> tuple[CreateBatchRequest, str]:
    """The body of ``POST /v1/batches``, and its hash: an Idempotency-Key replay must carry
    the same body (compared as sorted JSON, so key order and spacing do not matter)."""
    body = json_object(raw, "a JSON object")
    request_hash = hashlib.sha256(_canonical(body)).hexdigest()
    try:
        request = msgspec.convert(body, CreateBatchRequest)
    except msgspec.ValidationError as exc:
        raise _refusal(explain(exc), body) from None
    _check_file_id(request.input_file_id)
    _check_endpoint(request.endpoint)
    _check_metadata(request.metadata)
    if request.output_expires_after is not None:
        _check_expiry_seconds(request.output_expires_after.seconds)
    return request, request_hash


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """``raw`` decoded, if it is a JSON object; else a 400 ``invalid_json`` saying that the
    body must be ``what``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise InvalidInput(f"The request body must be {what}.", code="invalid_json")
    return body


def _bad(message: str, param: str | None, code: str = "invalid_value") -> InvalidInput:
    return InvalidInput(message, code=code, param=param)


def _refusal(problem: DecodeProblem, body: dict[str, Any]) -> InvalidInput:
    field = problem.field
    if problem.broken is Broken.UNKNOWN and problem.param != field:
        # Inside a field's object: only output_expires_after is one.
        return _bad(
            f"Unknown field '{problem.param}'; 'output_expires_after' takes only 'anchor' and "
            "'seconds'.",
            problem.param,
            "unknown_parameter",
        )
    if problem.broken is Broken.UNKNOWN:
        return _bad(
            f"Unknown field '{field}'; a batch takes {sorted(FIELD_RULES)}.",
            field,
            "unknown_parameter",
        )
    rule = FIELD_RULES.get(field or "")
    if rule is not None:
        # The field's own rule says what is wrong in its words (and which metadata key).
        try:
            rule(body.get(field or ""))
        except InvalidInput as exc:
            return exc
    return _bad(f"The request body is not a batch: {problem.reason}.", field)


def _canonical(body: dict[str, Any]) -> bytes:
    """The body as sorted JSON; the encoder refuses what no field of a batch can hold (nesting
    past 254 levels, integers beyond 64 bits)."""
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        pass
    field = next(name for name in sorted(body) if not _encodes({name: body[name]}))
    raise _bad(
        f"'{field}' cannot be stored: it nests JSON deeper than {MAX_REQUEST_DEPTH} levels or "
        "holds an integer beyond 64 bits.",
        field,
    )


def _encodes(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


# Each rule takes a field's value as sent (None when absent) and raises what it breaks.


def _check_file_id(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise _bad(
            "'input_file_id' is required: the id of an uploaded batch file.",
            "input_file_id",
            "missing_required_parameter",
        )


def _check_endpoint(value: Any) -> None:
    if not isinstance(value, str) or value not in ENDPOINTS:
        raise _bad(f"'endpoint' must be one of {sorted(ENDPOINTS)} (it is {value!r}).", "endpoint")


def _check_window(value: Any) -> None:
    if not isinstance(value, str):
        raise _bad("'completion_window' must be a string such as '24h'.", "completion_window")


def _check_metadata(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("'metadata' must be an object of string keys and values, or null.", "metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise _bad(
            f"'metadata' has {len(value)} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
            "metadata",
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise _bad(
                f"metadata key {key[:20]!r}... is longer than {MAX_METADATA_KEY} characters.",
                f"metadata.{key}",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise _bad(
                f"metadata value of {key!r} must be a string of at most {MAX_METADATA_VALUE} "
                "characters.",
                f"metadata.{key}",
            )


def _check_webhook_url(value: Any) -> None:
    # Where it may point is the batch service's to judge (the webhook address rules).
    if value is not None and (not isinstance(value, str) or not value):
        raise _bad("'webhook_url' must be an HTTPS URL on a public host, or null.", "webhook_url")


def _check_expiry(value: Any) -> None:
    """``output_expires_after: {anchor: "created_at", seconds: N}`` (SPEC §4.1)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise _bad(
            '\'output_expires_after\' must be {"anchor": "created_at", "seconds": N}.',
            "output_expires_after",
        )
    _check_expiry_seconds(value.get("seconds"))


def _check_expiry_seconds(value: Any) -> None:
    if not isinstance(value, int) or not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise _bad(
            f"'output_expires_after.seconds' must be a whole number from {MIN_EXPIRY_S} to "
            f"{MAX_EXPIRY_S}.",
            "output_expires_after.seconds",
        )


def _check_priority(value: Any) -> None:
    # The org's cap is the batch service's to check; here only the shape.
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(
            f"'priority' must be a whole number from {MIN_PRIORITY} to your organization's cap "
            "(higher runs first).",
            "priority",
        )


def _check_output_validation(value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise _bad(
            "'output_validation' must be true or false: true checks each answer against its "
            "line's response_format schema.",
            "output_validation",
        )


# One rule per field of CreateBatchRequest (a unit test holds the two to the same names).
FIELD_RULES: dict[str, Callable[[Any], None]] = {
    "input_file_id": _check_file_id,
    "endpoint": _check_endpoint,
    "completion_window": _check_window,
    "metadata": _check_metadata,
    "webhook_url": _check_webhook_url,
    "output_expires_after": _check_expiry,
    "priority": _check_priority,
    "output_validation": _check_output_validation,
}
