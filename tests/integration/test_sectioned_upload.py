"""A BatchRouter sectioned batch is the plain batch of its expanded requests (SPEC §8.1): the
same stored requests, the same results, errors that name the file's own lines."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import SIM_MODEL, InProcess, in_process_backfill, jsonl, running_simulator

FORMAT = {"format": "batchrouter.sectioned.v1"}
_TEXT = st.text(min_size=1, max_size=12)


def _message(draw: st.DrawFn) -> dict[str, str]:
    return {"role": draw(st.sampled_from(["system", "user", "assistant"])), "content": draw(_TEXT)}


@st.composite
def sectioned_files(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A sectioned file's lines, and the plain lines it stands for, expanded independently."""
    lines: list[dict[str, Any]] = [FORMAT]
    plain: list[dict[str, Any]] = []
    ids = iter(draw(st.lists(_TEXT, min_size=12, max_size=12, unique=True)))
    for n in range(draw(st.integers(1, 3))):
        shared: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": draw(st.integers(1, 8))}
        if draw(st.booleans()):
            shared["temperature"] = draw(st.sampled_from([0, 0.5, 1]))
        prefix = [_message(draw) for _ in range(draw(st.integers(0, 2)))]
        sec: dict[str, Any] = {"id": f"section-{n}", "body": shared}
        # A section may leave its messages out, or give an empty list.
        empty_messages: bool = draw(st.booleans())
        if prefix or empty_messages:
            sec["messages"] = prefix
        lines.append({"section": sec})
        for _ in range(draw(st.integers(1, 4))):
            own = [_message(draw) for _ in range(draw(st.integers(1, 2)))]
            body: dict[str, Any] = {"messages": own}
            if draw(st.booleans()):
                body["max_tokens"] = draw(st.integers(1, 8))
            line: dict[str, Any] = {"custom_id": next(ids), "body": body}
            if draw(st.booleans()):
                line["method"], line["url"] = "POST", "/v1/chat/completions"
            lines.append(line)
            merged = {**shared, **body, "messages": prefix + own}
            plain.append(
                {
                    "custom_id": line["custom_id"],
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": merged,
                }
            )
    return lines, plain


def _result(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a result row says about its request, without the ids and times of this run."""
    response = row["response"]
    body = dict(response["body"])
    for name in ("id", "created"):
        body.pop(name, None)
    usage = dict(body.pop("usage"))
    # The simulator's prefix cache is warm for the second batch: what was cached may differ.
    usage.pop("prompt_tokens_details", None)
    return (
        row["custom_id"],
        response["status_code"],
        orjson.dumps(body, option=orjson.OPT_SORT_KEYS),
        orjson.dumps(usage, option=orjson.OPT_SORT_KEYS),
        row["error"],
    )


async def _run(backfill: InProcess, content: bytes) -> tuple[list[Any], list[dict[str, Any]]]:
    uploaded = await backfill.upload(content)
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    stored = (await backfill.client.get(f"/v1/files/{file_id}/content")).content
    created = await backfill.create(file_id)
    assert created.status_code == 200, created.text
    batch = await backfill.wait(created.json()["id"])
    assert batch["status"] == "completed"
    rows = await backfill.rows(batch["output_file_id"]) + await backfill.rows(
        batch["error_file_id"]
    )
    return sorted(_result(r) for r in rows), [orjson.loads(x) for x in stored.splitlines()]


async def _equivalent(tmp: Path, lines: list[dict[str, Any]], plain: list[dict[str, Any]]) -> None:
    async with running_simulator() as (url, _), in_process_backfill(tmp, url) as backfill:
        sectioned_results, stored = await _run(backfill, jsonl(lines))
        plain_results, _ = await _run(backfill, jsonl(plain))
    assert sectioned_results == plain_results
    # Stored expanded: the plain lines, each naming its section.
    assert [{k: v for k, v in s.items() if k != "section"} for s in stored] == plain
    assert all(s["section"].startswith("section-") for s in stored)


@settings(
    max_examples=8,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sectioned_files())
def test_a_sectioned_batch_is_the_plain_batch_of_its_requests(
    tmp_path_factory: Any, file: tuple[list[dict[str, Any]], list[dict[str, Any]]]
) -> None:
    lines, plain = file
    asyncio.run(_equivalent(tmp_path_factory.mktemp("sectioned"), lines, plain))


async def test_errors_name_the_line_of_the_file(backfill: InProcess) -> None:
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4}}},
        {"custom_id": "1", "body": {"messages": [{"role": "user", "content": "x"}]}},
        {"section": {"id": "b", "body": {"model": SIM_MODEL}}},
        {"custom_id": "2", "body": {"messages": [{"role": "user", "content": "x"}]}},
    ]
    response = await backfill.upload(jsonl(lines))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["line"]) == (
        "missing_required_parameter",
        "body.max_tokens",
        5,
    )
    assert error["message"].startswith("Line 5:")


async def test_request_limit_counts_requests_not_section_lines(tmp_path: Path) -> None:
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4}}},
    ]
    lines += [
        {"custom_id": str(i), "body": {"messages": [{"role": "user", "content": "x"}]}}
        for i in range(3)
    ]
    async with running_simulator() as (url, _):
        async with in_process_backfill(tmp_path / "a", url, max_lines=3) as backfill:
            ok = await backfill.upload(jsonl(lines))
            assert ok.status_code == 200, ok.text
            assert ok.json()["bytes"] > 0
        async with in_process_backfill(tmp_path / "b", url, max_lines=2) as backfill:
            refused = (await backfill.upload(jsonl(lines))).json()["error"]
            assert (refused["code"], refused["line"]) == ("too_many_requests_in_file", 5)


async def test_expansion_is_bounded(tmp_path: Path) -> None:
    prefix = [{"role": "system", "content": "p" * 1000}]
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4}, "messages": prefix}},
    ]
    lines += [
        {"custom_id": str(i), "body": {"messages": [{"role": "user", "content": "x"}]}}
        for i in range(50)
    ]
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url, max_expanded_file_bytes=20_000) as backfill,
    ):
        refused = (await backfill.upload(jsonl(lines))).json()["error"]
    assert refused["code"] == "file_too_large"
    assert "expanded" in refused["message"]


async def test_a_shared_fault_names_the_section_line(backfill: InProcess) -> None:
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4}}},
        {"custom_id": "1", "body": {"messages": [{"role": "user", "content": "x"}]}},
        {
            "section": {
                "id": "b",
                "body": {"model": SIM_MODEL, "max_tokens": 4},
                "messages": [{"role": "robot", "content": "p"}],
            }
        },
        {"custom_id": "2", "body": {"messages": [{"role": "user", "content": "x"}]}},
    ]
    error = (await backfill.upload(jsonl(lines))).json()["error"]
    assert (error["line"], error["param"]) == (4, "section.messages[0].role")
    assert error["message"].startswith("Line 4: 'section.messages[0].role'")


async def test_a_bad_request_before_a_section_is_the_one_reported(backfill: InProcess) -> None:
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL}}},
        {"custom_id": "1", "body": {"messages": [{"role": "user", "content": "x"}]}},
        {"section": {"id": "b", "body": {"model": SIM_MODEL, "max_tokens": 4}}},
        {"custom_id": "2", "body": {"messages": [{"role": "user", "content": "x"}]}},
    ]
    error = (await backfill.upload(jsonl(lines))).json()["error"]
    assert (error["code"], error["line"], error["param"]) == (
        "missing_required_parameter",
        3,
        "body.max_tokens",
    )


async def test_a_section_nested_too_deeply_gets_the_nesting_error(backfill: InProcess) -> None:
    # The 2026-12-05 review, Info "deep section": these got "unknown field 'section'".
    depth = 100_000
    first = [
        orjson.dumps(FORMAT),
        orjson.dumps({"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4}}}),
        orjson.dumps({"custom_id": "1", "body": {"messages": [{"role": "user", "content": "x"}]}}),
    ]
    deep_lines = [
        b'{"section":' * depth + b"{}" + b"}" * depth,
        b'{"section":{"id":"b","body":{"x":' + b"[" * depth + b"]" * depth + b"}}}",
    ]
    for deep in deep_lines:
        response = await backfill.upload(b"\n".join([*first, deep]) + b"\n")
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["line"]) == ("invalid_json_line", 4)
        assert "nests JSON too deeply" in error["message"], error["message"]


async def test_a_shared_tool_that_reaches_past_the_request_names_the_section(
    backfill: InProcess,
) -> None:
    mcp = {"type": "mcp", "server_label": "m", "server_url": "http://169.254.169.254/latest/"}
    lines: list[dict[str, Any]] = [
        FORMAT,
        {"section": {"id": "a", "body": {"model": SIM_MODEL, "max_tokens": 4, "tools": [mcp]}}},
        {"custom_id": "1", "body": {"messages": [{"role": "user", "content": "x"}]}},
    ]
    error = (await backfill.upload(jsonl(lines))).json()["error"]
    assert (error["line"], error["param"]) == (2, "section.body.tools[0].type")
    assert error["message"].startswith("Line 2: 'section.body.tools[0].type'")
