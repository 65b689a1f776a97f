"""``GET /v1/batches/{id}/results``: rows while a batch runs, exactly the rows of its files.

SPEC §4.8 (results readable while a batch runs, standard rows, resumable), §4.2 (the batch's
file ids stay null until it ends), §6.3 (one row per custom_id).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.integration.test_auth import error_of, other_org_key
from tests.support import (
    FAST,
    TERMINAL,
    InProcess,
    backfill_on,
    chat_line,
    eventually,
    wait_terminal,
)

READ_ONLY = frozenset({"requests:read"})


async def page(
    bf: InProcess,
    batch_id: str,
    after: str | None = None,
    limit: int | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[list[bytes], str, bool]:
    """(rows, next cursor, complete) of one page."""
    params: dict[str, Any] = {}
    if after is not None:
        params["after"] = after
    if limit is not None:
        params["limit"] = limit
    response = await bf.client.get(
        f"/v1/batches/{batch_id}/results", params=params, headers=headers
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/jsonl")
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-backfill-batch-status"]
    rows = response.content.splitlines()
    assert response.content == b"".join(row + b"\n" for row in rows)
    return (
        rows,
        response.headers["x-backfill-next-cursor"],
        (response.headers["x-backfill-complete"] == "true"),
    )


async def read_to_end(
    bf: InProcess, batch_id: str, after: str | None = None, limit: int = 1000
) -> tuple[list[bytes], str]:
    """Every row from ``after`` on, of a batch that is over; and the cursor at the end."""
    rows: list[bytes] = []
    for _ in range(10_000):
        got, after, complete = await page(bf, batch_id, after, limit)
        rows += got
        if complete:
            assert after is not None
            return rows, after
    raise AssertionError("the pages never said complete")


async def file_rows(bf: InProcess, file_id: str | None) -> list[bytes]:
    assert file_id is not None
    response = await bf.client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return response.content.splitlines()


async def final_rows(bf: InProcess, batch: dict[str, Any]) -> list[bytes]:
    return await file_rows(bf, batch["output_file_id"]) + await file_rows(
        bf, batch["error_file_id"]
    )


def assert_once_each(rows: list[bytes], custom_ids: list[str]) -> None:
    seen = Counter(orjson.loads(row)["custom_id"] for row in rows)
    assert not [c for c, n in seen.items() if n > 1], "a custom_id was served twice"
    assert set(seen) == set(custom_ids)


async def test_pages_read_while_running_hold_exactly_the_rows_of_the_final_files(
    tmp_path: Path,
) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=3) as (bf, _):
        lines = [chat_line(f"ok-{i:02d}", f"[[sim:delay_ms={40 * i}]] q{i}") for i in range(24)]
        lines += [chat_line(f"bad-{i}", "[[sim:status=400]]") for i in range(3)]
        batch_id = (await bf.submit(lines))["id"]
        rows: list[bytes] = []
        read_while_running = 0
        after: str | None = None
        while True:
            got, after, complete = await page(bf, batch_id, after, limit=4)
            rows += got
            # Read after the page: still running now means it was running for the page too.
            batch = await bf.batch(batch_id)
            if batch["status"] not in TERMINAL:
                # OpenAI's shape holds: no file before the end, whatever was read already.
                assert batch["output_file_id"] is None
                assert batch["error_file_id"] is None
                assert not complete
                read_while_running += len(got)
            if complete:
                break
        assert read_while_running > 0, "no row was read before the batch ended"
        batch = await bf.batch(batch_id)
        assert batch["status"] == "completed"
        final = await final_rows(bf, batch)
        assert sorted(rows) == sorted(final)
        assert_once_each(rows, [line["custom_id"] for line in lines])
        # Each row says which file it belongs to, by its own fields.
        errors = [orjson.loads(r) for r in await file_rows(bf, batch["error_file_id"])]
        assert sorted(e["custom_id"] for e in errors) == ["bad-0", "bad-1", "bad-2"]
        # Once complete, the last cursor stays complete and serves nothing more.
        assert await page(bf, batch_id, after) == ([], after, True)


async def test_a_saved_cursor_reads_on_from_where_it_was(backfill: InProcess) -> None:
    lines = [chat_line(f"r-{i}") for i in range(23)]
    batch = await backfill.run_batch(lines)
    everything, end = await read_to_end(backfill, batch["id"])
    assert len(everything) == 23
    first, cursor, complete = await page(backfill, batch["id"], limit=5)
    assert (first, complete) == (everything[:5], False)
    # The same cursor, read twice (a client that lost the answer), gives the same rows.
    rest_once, end_once = await read_to_end(backfill, batch["id"], cursor, limit=4)
    rest_twice, end_twice = await read_to_end(backfill, batch["id"], cursor, limit=4)
    assert rest_once == rest_twice == everything[5:]
    assert end_once == end_twice == end
    assert sorted(everything) == sorted(await final_rows(backfill, batch))
    # A read-only key reads results too.
    reader = await backfill.backfill.services.tenants.create_key("default", READ_ONLY)
    got, _, _ = await page(
        backfill, batch["id"], limit=2, headers={"Authorization": f"Bearer {reader}"}
    )
    assert got == everything[:2]


async def test_a_cancelled_batch_serves_its_unrun_lines_after_the_finished_ones(
    tmp_path: Path,
) -> None:
    async with backfill_on(tmp_path, FAST, max_concurrency=2) as (bf, _):
        lines = [chat_line(f"fast-{i}", f"quick {i}") for i in range(2)]
        lines += [chat_line(f"slow-{i:02d}", f"[[sim:delay_ms=1500]] slow {i}") for i in range(10)]
        batch_id = (await bf.submit(lines))["id"]

        async def two_done() -> bool:
            return bool((await bf.batch(batch_id))["request_counts"]["completed"] >= 2)

        await eventually(two_done, what="two finished requests")
        early, cursor, complete = await page(bf, batch_id, limit=3)
        assert not complete
        cancelled = await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})
        assert cancelled.status_code == 200, cancelled.text
        await wait_terminal(bf.client, batch_id, timeout_s=30)
        rest, _ = await read_to_end(bf, batch_id, cursor, limit=3)
        batch = await bf.batch(batch_id)
        assert batch["status"] == "cancelled"
        rows = early + rest
        assert sorted(rows) == sorted(await final_rows(bf, batch))
        assert_once_each(rows, [line["custom_id"] for line in lines])
        codes = Counter((orjson.loads(r)["error"] or {}).get("code") for r in rows)
        assert codes["batch_cancelled"] >= 1
        # The unrun lines come last, by line.
        unrun = [orjson.loads(r)["custom_id"] for r in rows if b"batch_cancelled" in r]
        assert unrun == sorted(unrun)
        assert rows[-len(unrun) :] == [r for r in rows if b"batch_cancelled" in r]


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("after", ["nope", "czox!", "czo", "A" * 100, "aTot" * 3])
async def test_a_cursor_this_endpoint_did_not_give_is_400(backfill: InProcess, after: str) -> None:
    batch = await backfill.run_batch([chat_line("a")])
    response = await backfill.client.get(
        f"/v1/batches/{batch['id']}/results", params={"after": after}
    )
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("after", "invalid_value")
    assert "x-backfill-next-cursor" in error["message"]


@pytest.mark.parametrize("limit", [0, -1, 10_001])
async def test_a_limit_out_of_range_is_400(backfill: InProcess, limit: int) -> None:
    batch = await backfill.run_batch([chat_line("a")])
    response = await backfill.client.get(
        f"/v1/batches/{batch['id']}/results", params={"limit": limit}
    )
    error = error_of(response, 400)
    assert error["param"] == "limit"
    assert "10000" in error["message"]


async def test_another_orgs_batch_is_404(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a")])
    other = await other_org_key(backfill)
    for batch_id in (batch["id"], "batch_unknown"):
        response = await backfill.client.get(
            f"/v1/batches/{batch_id}/results", headers={"Authorization": f"Bearer {other}"}
        )
        assert error_of(response, 404)["param"] == "batch_id"


async def test_results_removed_with_the_output_file_are_410(backfill: InProcess) -> None:
    batch = await backfill.run_batch([chat_line("a"), chat_line("b")])
    _, cursor, _ = await page(backfill, batch["id"], limit=1)
    deleted = await backfill.client.delete(f"/v1/files/{batch['output_file_id']}")
    assert deleted.status_code == 200, deleted.text
    for after in (None, cursor):
        params = {"after": after} if after else {}
        response = await backfill.client.get(f"/v1/batches/{batch['id']}/results", params=params)
        error = error_of(response, 410)
        assert error["code"] == "results_removed"
        assert batch["output_file_id"] in error["message"]
