"""Fuzz the upload validator (SPEC §3.1, §5, §12): mutated input files never crash the server.

Hypothesis starts from valid files and mutates them at the JSON level (fields dropped, renamed,
retyped, huge numbers, deep nesting, unicode, duplicate ids) and at the byte level (flips,
insertions, deletions, truncation, invalid UTF-8, BOM, NUL, CRLF, blank lines, sizes past the
limits). Every upload must end, and end in one of two ways only:

- 200, ``status: "processed"``, the stored bytes identical to the upload; or
- 400 in the OpenAI envelope whose message names a line ("Line N", N within the file), with
  nothing stored.

Accepted files must also be runnable: the last test runs batches of accepted files whose lines
carry edge values in free-form body fields, and every request must get exactly one result row.

One in-process Backfill (and simulated engine) serves the whole module: the tests are sync
functions that drive it through one ``asyncio.Runner``. Seeds are fixed (``derandomize``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backfill.simulator.server import SimulatorConfig
from tests.support import (
    InProcess,
    chat_line,
    in_process_backfill,
    running_simulator,
)

UPLOAD_TIMEOUT_S = 20.0
MAX_LINE_BYTES = 16 * 1024
MAX_FILE_BYTES = 256 * 1024
MAX_LINES = 200
ERROR_CODES = {
    "invalid_json_line",
    "missing_required_parameter",
    "invalid_value",
    "duplicate_custom_id",
    "streaming_unsupported",
    "unsupported_parameter",
    "invalid_url",
    "model_not_found",
    "mixed_models",
    "unsupported_modality",
    "line_too_large",
    "file_too_large",
    "too_many_requests_in_file",
}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- the shared in-process Backfill -------------------------------------------------------


@dataclass
class Harness:
    runner: asyncio.Runner
    bf: InProcess
    outcomes: Counter[str] = field(default_factory=Counter)

    def run(self, coro: Any, timeout_s: float = UPLOAD_TIMEOUT_S) -> Any:
        return self.runner.run(asyncio.wait_for(coro, timeout_s))

    def upload(self, content: bytes) -> httpx.Response:
        response: httpx.Response = self.run(self.bf.upload(content))
        return response

    def file_count(self) -> int:
        listed: httpx.Response = self.run(self.bf.client.get("/v1/files"))
        assert listed.status_code == 200, listed.text
        return len(listed.json()["data"])

    @property
    def blob_root(self) -> Path:
        return self.bf.settings.resolved_storage_path

    def blobs(self) -> set[str]:
        root = self.blob_root
        return {
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file() and ".tmp" not in p.relative_to(root).parts
        }

    def tmp_files(self) -> list[Path]:
        tmp = self.blob_root / ".tmp"
        return list(tmp.iterdir()) if tmp.exists() else []


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    runner = asyncio.Runner()
    stack = AsyncExitStack()

    async def start() -> InProcess:
        url, _ = await stack.enter_async_context(
            running_simulator(SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4))
        )
        return await stack.enter_async_context(
            in_process_backfill(
                tmp_path_factory.mktemp("fuzz"),
                url,
                max_line_bytes=MAX_LINE_BYTES,
                max_file_bytes=MAX_FILE_BYTES,
                max_lines=MAX_LINES,
                max_unfinished_batches=100,
            )
        )

    try:
        h = Harness(runner, runner.run(start()))
        yield h
        print(f"\nfuzz upload outcomes: {dict(h.outcomes)}")
    finally:
        runner.run(stack.aclose())
        runner.close()


# ---- the property --------------------------------------------------------------------------


def check_upload(h: Harness, content: bytes) -> httpx.Response:
    """Upload ``content``; assert it is processed whole or rejected naming a line."""
    files_before = h.file_count()
    blobs_before = h.blobs()
    response = h.upload(content)
    where = f"for {len(content)} bytes starting {content[:300]!r}"
    assert response.status_code in (200, 400), f"{response.status_code} {response.text} {where}"
    assert response.headers.get("x-request-id"), where
    body = response.json()
    if response.status_code == 200:
        h.outcomes["processed"] += 1
        assert body["status"] == "processed", body
        assert body["bytes"] == len(content), body
        stored: httpx.Response = h.run(h.bf.client.get(f"/v1/files/{body['id']}/content"))
        assert stored.status_code == 200, stored.text
        assert stored.content == content, "the stored file differs from the upload"
        assert h.file_count() == files_before + 1
        assert h.blobs() - blobs_before <= {f"files/{body['id']}", f"files/{body['id']}.index"}
    else:
        h.outcomes["rejected"] += 1
        assert set(body) == {"error"}, body
        error = body["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["code"] in ERROR_CODES, error
        assert response.headers["x-should-retry"] == "false"
        line = error.get("line")
        last = content.count(b"\n") + 1
        assert isinstance(line, int), f"the error names no line: {error} {where}"
        assert 1 <= line <= last + 1, f"line {line} outside 1..{last + 1}: {error} {where}"
        if content:  # an empty file has no line to name; the envelope still says line 1
            assert re.search(rf"\bline {line}\b", error["message"], re.IGNORECASE), error
        assert h.file_count() == files_before, "a rejected upload left a visible file"
        assert h.blobs() == blobs_before, "a rejected upload left stored content"
    assert h.tmp_files() == [], "an upload left a partial blob behind"
    return response


# ---- strategies ----------------------------------------------------------------------------

HUGE_NUMBERS = [
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**30,
    -(10**30),
    0,
    -1,
    1.5,
    1e308,
    -1e-308,
    float("inf"),
    float("nan"),
]
SPECIAL_BYTES = [
    b"\x00",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\xfe\xff",
    b"\xc3(",
    b"\xc0\xaf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\r",
    b"\r\n",
    b"\n",
    b"\n\n",
    b" ",
    b"\t",
    b"\\",
    b'"',
    b"{",
    b"}",
    b"[",
    b",",
    b":",
    b"\\ud800",
    b"\\u0000",
    b"null",
    b"1e999999",
]
TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from("\u0000\u2028é😀"),
    max_size=40,
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE_NUMBERS)
    | st.floats(allow_nan=True)
    | TEXT
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=10,
)
FIELD_NAMES = st.sampled_from(
    [
        "custom_id",
        "method",
        "url",
        "body",
        "body.model",
        "body.messages",
        "body.max_tokens",
        "body.max_completion_tokens",
        "body.stream",
        "body.prompt",
        "body.temperature",
        "body.messages.0.role",
        "body.messages.0.content",
        "extra",
    ]
)

Op = Callable[[list[dict[str, Any]]], None]


def _container(row: dict[str, Any], path: str) -> tuple[Any, str | int] | None:
    """The object holding ``path`` (dotted, digits index lists) and the last key."""
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = row
    for part in parts[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(parts[-1], int)):
        return node, parts[-1]
    return None


def _drop(i: int, path: str) -> Op:
    def op(rows: list[dict[str, Any]]) -> None:
        found = _container(rows[i % len(rows)], path)
        if found and isinstance(found[0], dict):
            found[0].pop(found[1], None)

    return op


def _rename(i: int, path: str, new: str) -> Op:
    def op(rows: list[dict[str, Any]]) -> None:
        found = _container(rows[i % len(rows)], path)
        if found and isinstance(found[0], dict) and found[1] in found[0]:
            found[0][new] = found[0].pop(found[1])

    return op


def _set(i: int, path: str, value: Any) -> Op:
    def op(rows: list[dict[str, Any]]) -> None:
        found = _container(rows[i % len(rows)], path)
        if found is None:
            return
        node, key = found
        if isinstance(node, dict) or (isinstance(key, int) and -len(node) <= key < len(node)):
            node[key] = copy.deepcopy(value)

    return op


def _duplicate_id(i: int, j: int) -> Op:
    def op(rows: list[dict[str, Any]]) -> None:
        rows[i % len(rows)]["custom_id"] = rows[j % len(rows)].get("custom_id")

    return op


def _nest(depth: int, as_dict: bool) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"n": value} if as_dict else [value]
    return value


_NEST = re.compile(rb'"__nest_(\d+)_([ld])__"')


def _nest_marker(depth: int, as_dict: bool) -> str:
    """Stands for a nest too deep for ``json.dumps``; ``serialize`` writes the bytes."""
    return f"__nest_{depth}_{'d' if as_dict else 'l'}__"


def _nested_bytes(match: re.Match[bytes]) -> bytes:
    depth = int(match.group(1))
    if match.group(2) == b"d":
        return b'{"n":' * depth + b"0" + b"}" * depth
    return b"[" * depth + b"0" + b"]" * depth


@st.composite
def json_ops(draw: st.DrawFn) -> Op:
    i = draw(st.integers(0, 20))
    path = draw(FIELD_NAMES)
    kind = draw(
        st.sampled_from(
            ["drop", "rename", "retype", "huge", "nest", "unicode", "dup", "long_id", "enum"]
        )
    )
    if kind == "drop":
        return _drop(i, path)
    if kind == "rename":
        return _rename(i, path, draw(TEXT))
    if kind == "retype":
        return _set(i, path, draw(JSON_VALUES))
    if kind == "huge":
        target = draw(st.sampled_from(["body.max_tokens", "body.max_completion_tokens", path]))
        return _set(i, target, draw(st.sampled_from(HUGE_NUMBERS)))
    if kind == "nest":
        depth = draw(st.sampled_from([5000, 1000, 300, 64]))
        # Free-form body fields are decoded whatever their depth; typed ones fail fast.
        target = draw(
            st.sampled_from(["body.x_nested", "body.temperature", "body.metadata", "body", path])
        )
        return _set(i, target, _nest_marker(depth, draw(st.booleans())))
    if kind == "unicode":
        target = draw(st.sampled_from(["custom_id", "body.messages.0.content", "body.model"]))
        return _set(i, target, draw(TEXT))
    if kind == "dup":
        return _duplicate_id(i, draw(st.integers(0, 20)))
    if kind == "long_id":
        return _set(i, "custom_id", "é" * draw(st.sampled_from([63, 64, 65, 200])))
    value = draw(
        st.sampled_from(
            [
                ("method", "GET"),
                ("url", "/v1/completions"),
                ("url", "/v1/embeddings"),
                ("body.stream", True),
                ("body.stream", False),
                ("body.model", "no-such-model"),
                ("body.messages", []),
                ("body.messages.0.role", "wizard"),
                ("body.messages.0.content", [{"type": "image_url", "image_url": {"url": "x"}}]),
                ("body.messages.0.content", [{"type": "text", "text": "hi"}]),
                ("body.messages.0.content", [{"type": "video"}]),
                ("body.max_tokens", 1024),
                ("body.max_tokens", 1025),
            ]
        )
    )
    return _set(i, value[0], value[1])


def serialize(rows: list[dict[str, Any]], ensure_ascii: bool, spaced: bool) -> bytes:
    separators = (", ", ": ") if spaced else (",", ":")
    content = b"".join(
        json.dumps(r, ensure_ascii=ensure_ascii, separators=separators).encode(
            "utf-8", "surrogatepass"
        )
        + b"\n"
        for r in rows
    )
    return _NEST.sub(_nested_bytes, content)


def valid_rows(n: int, contents: list[str]) -> list[dict[str, Any]]:
    return [chat_line(f"req-{i}", contents[i % len(contents)] or "hi") for i in range(n)]


@st.composite
def json_mutated_files(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 6))
    rows = valid_rows(n, draw(st.lists(TEXT, min_size=1, max_size=3)))
    for op in draw(st.lists(json_ops(), min_size=1, max_size=3)):
        op(rows)
    return serialize(rows, draw(st.booleans()), draw(st.booleans()))


def _byte_op(content: bytes, kind: str, pos: int, arg: int, blob: bytes) -> bytes:
    at = pos % (len(content) + 1)
    if kind == "flip" and content:
        at = pos % len(content)
        return content[:at] + bytes([content[at] ^ (arg % 255 + 1)]) + content[at + 1 :]
    if kind == "insert":
        return content[:at] + blob + content[at:]
    if kind == "delete":
        return content[:at] + content[at + 1 + arg % 64 :]
    if kind == "truncate":
        return content[:at]
    if kind == "bom":
        return b"\xef\xbb\xbf" + content
    if kind == "crlf":
        return content.replace(b"\n", b"\r\n")
    if kind == "blank_line":
        lines = content.split(b"\n")
        lines.insert(pos % (len(lines) + 1), b"" if arg % 2 else b" \t")
        return b"\n".join(lines)
    if kind == "strip_final_newline":
        return content.rstrip(b"\n")
    if kind == "duplicate_line":
        lines = content.split(b"\n")
        k = pos % len(lines)
        return b"\n".join([*lines[: k + 1], lines[k], *lines[k + 1 :]])
    if kind == "nul":
        return content[:at] + b"\x00" * (1 + arg % 4) + content[at:]
    return content


@st.composite
def byte_mutated_files(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 6))
    content = serialize(valid_rows(n, draw(st.lists(TEXT, min_size=1, max_size=3))), False, False)
    kinds = st.sampled_from(
        [
            "flip",
            "insert",
            "delete",
            "truncate",
            "bom",
            "crlf",
            "blank_line",
            "strip_final_newline",
            "duplicate_line",
            "nul",
        ]
    )
    blobs = st.sampled_from(SPECIAL_BYTES) | st.binary(min_size=1, max_size=8)
    for _ in range(draw(st.integers(1, 4))):
        content = _byte_op(
            content,
            draw(kinds),
            draw(st.integers(0, 10**6)),
            draw(st.integers(0, 10**6)),
            draw(blobs),
        )
    return content


@st.composite
def sized_files(draw: st.DrawFn) -> bytes:
    """Files near and past the line, line-count and file-size limits of this server."""
    lines = draw(st.sampled_from([1, 2, MAX_LINES - 1, MAX_LINES, MAX_LINES + 1, 400]))
    # A line's JSON envelope is about 130 bytes; pick contents that put lines either side of
    # the line limit, and files either side of the file limit.
    size = draw(
        st.sampled_from(
            [0, 10, MAX_LINE_BYTES - 200, MAX_LINE_BYTES - 110, MAX_LINE_BYTES, 2 * MAX_LINE_BYTES]
        )
    )
    big_at = draw(st.integers(0, lines - 1))
    small = min(size, MAX_FILE_BYTES // (2 * lines))
    rows = [
        chat_line(f"r{i}", "x" * (size if i == big_at else draw(st.sampled_from([1, small]))))
        for i in range(lines)
    ]
    content = serialize(rows, True, False)
    if draw(st.booleans()):
        content = content.replace(b"\n", b"\r\n")
    return content


# ---- tests ---------------------------------------------------------------------------------


@FUZZ
@given(content=json_mutated_files())
def test_json_level_mutations_are_processed_or_name_a_line(
    harness: Harness, content: bytes
) -> None:
    check_upload(harness, content)


@FUZZ
@given(content=byte_mutated_files())
def test_byte_level_mutations_are_processed_or_name_a_line(
    harness: Harness, content: bytes
) -> None:
    check_upload(harness, content)


@settings(FUZZ, max_examples=25)
@given(content=sized_files())
def test_sizes_around_the_limits_are_processed_or_name_a_line(
    harness: Harness, content: bytes
) -> None:
    response = check_upload(harness, content)
    if response.status_code == 400:
        code = response.json()["error"]["code"]
        lines = content.count(b"\n")
        assert code in {"line_too_large", "file_too_large", "too_many_requests_in_file"}, (
            f"{code} for a file of {lines} well-formed lines"
        )


def test_the_extremes_of_each_mutation_kind(harness: Harness) -> None:
    """Fixed, readable cases that the strategies above reach only by chance."""
    good = serialize(valid_rows(3, ["hi"]), False, False)
    cases = [
        b"",
        b"\n",
        b"\r\n",
        b"\xef\xbb\xbf" + good,
        good.replace(b"\n", b"\r\n"),
        good + b"\n",
        good.rstrip(b"\n"),
        good[:-10],
        good.replace(b"hi", b"h\x00i"),
        good.replace(b"hi", b"h\xffi"),
        good.replace(b"hi", b"\\ud800"),
        good.replace(b'"max_tokens":16', b'"max_tokens":' + b"9" * 400),
        good.replace(b'"max_tokens":16', b'"max_tokens":1e400'),
        good.replace(b'"max_tokens":16', b'"max_tokens":NaN'),
        good.replace(b'"max_tokens":16', b'"max_tokens":16,"x":' + b"[" * 100_000),
        good.replace(b'"max_tokens":16', b'"max_tokens":16,"x":' + b"[" * 5000 + b"]" * 5000),
        b"\x00" * 100,
        bytes(range(256)),
    ]
    failures = []
    for content in cases:
        try:
            check_upload(harness, content)
        except AssertionError as exc:  # try every case, report them all
            failures.append(f"{content[:80]!r}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


BOUNDARY = b"fuzzboundary7d3c"


def multipart(content: bytes) -> bytes:
    return (
        b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; '
        b'filename="input.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        + content
        + b"\r\n--"
        + BOUNDARY
        + b"--\r\n"
    )


@st.composite
def mutated_forms(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 4))
    body = multipart(serialize(valid_rows(n, ["hi"]), False, False))
    kinds = st.sampled_from(["flip", "insert", "delete", "truncate"])
    blobs = st.sampled_from([b"\r", b"\n", b"\r\n", b"--", b"\x00", b":", b";", b'"']) | st.binary(
        min_size=1, max_size=6
    )
    for _ in range(draw(st.integers(1, 3))):
        body = _byte_op(
            body,
            draw(kinds),
            draw(st.integers(0, 10**6)),
            draw(st.integers(0, 10**6)),
            draw(blobs),
        )
    return body


@settings(FUZZ, max_examples=40)
@given(body=mutated_forms())
def test_mutated_multipart_forms_never_fail_the_server(harness: Harness, body: bytes) -> None:
    """The form around the file is damaged: a 400 envelope, or a file from a complete form."""
    files_before = harness.file_count()
    response: httpx.Response = harness.run(
        harness.bf.client.post(
            "/v1/files",
            content=body,
            headers={"content-type": f"multipart/form-data; boundary={BOUNDARY.decode()}"},
        )
    )
    where = f"for the form {body!r}"
    assert response.status_code in (200, 400), f"{response.status_code} {response.text} {where}"
    harness.outcomes[f"form {response.status_code}"] += 1
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert harness.file_count() == files_before
    else:
        assert response.json()["status"] == "processed"
        # Only a complete form (its closing delimiter there) may yield a stored file.
        assert b"--" + BOUNDARY + b"--" in body, f"a truncated form was stored {where}"
    assert harness.tmp_files() == []


def test_a_form_cut_short_is_not_stored(harness: Harness) -> None:
    """A body that stops after a whole line, before the closing delimiter, is incomplete: the
    file may have had more lines. It must not become a (shorter) processed file."""
    content = serialize(valid_rows(3, ["hi"]), False, False)
    first_line = content.index(b"\n") + 1
    body = multipart(content)
    cut = body.index(content) + first_line
    files_before = harness.file_count()
    response: httpx.Response = harness.run(
        harness.bf.client.post(
            "/v1/files",
            content=body[:cut],
            headers={"content-type": f"multipart/form-data; boundary={BOUNDARY.decode()}"},
        )
    )
    assert response.status_code == 400, response.text
    assert harness.file_count() == files_before


# ---- accepted means runnable -----------------------------------------------------------------

EDGE_VALUES: dict[str, Any] = {
    "unicode": "é😀\u2028\u0000 نص",
    "large_int_64": 2**63 - 1,
    "huge_int": 10**30,
    "tiny_float": 5e-324,
    "big_float": 1.7976931348623157e308,
    "nested_200": _nest(200, False),
    "nested_300": _nest(300, True),
}


@pytest.mark.parametrize("name", list(EDGE_VALUES))
def test_an_accepted_file_runs_to_one_result_per_line(harness: Harness, name: str) -> None:
    """§5 + §6.3: if the validator accepts a line, the batch gives it exactly one result row
    (success or error) — an accepted request must not get stuck forever."""
    rows = [chat_line(f"edge-{i}", "hi", temperature=0.5) for i in range(3)]
    rows[1]["body"]["x_extra"] = EDGE_VALUES[name]
    content = serialize(rows, name != "unicode", False)
    response = check_upload(harness, content)
    # Every edge value is valid JSON in a free-form field: the file must be accepted, or
    # this test would check nothing.
    assert response.status_code == 200, response.text
    bf = harness.bf
    created: httpx.Response = harness.run(bf.create(response.json()["id"]))
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    try:
        batch: dict[str, Any] = harness.run(bf.wait(batch_id), timeout_s=10)
    except TimeoutError:
        stuck = harness.run(bf.client.get(f"/v1/batches/{batch_id}")).json()
        raise AssertionError(
            f"an accepted file ({name}) never finished: {stuck['request_counts']}"
        ) from None
    out = harness.run(bf.rows(batch["output_file_id"]))
    err = harness.run(bf.rows(batch["error_file_id"]))
    assert batch["status"] == "completed", batch
    assert sorted(r["custom_id"] for r in out + err) == [r["custom_id"] for r in rows]
