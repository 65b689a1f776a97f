"""Schemathesis against the public API (SPEC §3, §4, §4.7, §11.6, §12).

The cases are generated from the app's own ``/openapi.json``, loaded from a real ``backfill up``
over HTTP: request bodies (the multipart upload form, the JSON creation and rerun bodies),
path parameters (real file and batch IDs offered beside arbitrary strings) and, for every
answer, its schema, with the OpenAI error envelope as ``default``.

Every operation then gets positive and negative (schema-violating) cases with the default
org's key. Checks: ``not_a_server_error`` (no 5xx), ``response_schema_conformance`` (the
answers are what the document says), and: every response carries ``x-request-id``; every error
is an OpenAI envelope; every non-retryable 4xx says ``x-should-retry: false``.
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


def with_known_ids(
    spec: dict[str, Any], file_ids: list[str], batch_ids: list[str]
) -> dict[str, Any]:
    """The app's document, with real file and batch IDs (and creation windows) offered beside
    arbitrary strings."""
    spec = copy.deepcopy(spec)
    ids = {"file_id": file_ids, "batch_id": batch_ids}
    for operations in spec["paths"].values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                known = ids.get(parameter["name"])
                if parameter["in"] == "path" and known:
                    parameter["schema"] = {"anyOf": [{"enum": known}, {"type": "string"}]}
    # The creation body likewise, so valid creations (and their answers' schema) are generated.
    create = copy.deepcopy(spec["components"]["schemas"]["CreateBatchRequest"])
    fields = create["properties"]
    fields["input_file_id"] = {"enum": file_ids}
    fields["completion_window"] = {"enum": ["24h", "48h", "7d"]}
    # The seeded files hold chat lines; a webhook URL must name a public host, which none
    # here is. Unknown files, other windows, endpoints and webhook URLs are still sent by the
    # negative cases.
    fields["endpoint"] = {"const": "/v1/chat/completions"}
    del fields["webhook_url"]
    spec["components"]["schemas"]["CreateBatchRequest"] = create
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
    schema = schemathesis.openapi.from_dict(with_known_ids(spec, file_ids, batch_ids))
    auth = {"Authorization": f"Bearer {server_process.key}"}
    statuses: Counter[int] = Counter()
    successes: Counter[str] = Counter()
    create_codes: Counter[str] = Counter()
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
                if response.status_code == 200:
                    successes[case.operation.label] += 1
                elif case.operation.label == "POST /v1/batches" and response.status_code < 500:
                    error = response.json().get("error", {})
                    create_codes[f"{error.get('code')}:{error.get('param')}"] += 1
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
    # The creation body offers real file IDs: valid creations are generated and checked.
    assert successes["POST /v1/batches"] > 0, (dict(successes), create_codes)
