"""Priority and pause through the API, on a real engine (the simulator over HTTP): a batch's
priority at creation (within its org's cap) and after (``POST /v1/batches/{id}``), a
priority-10 batch overtaking a 20,000-line batch of its own org within one claim cycle while
a priority-0 one waits (``waiting_on: priority``), and pause and resume (``waiting_on:
paused``; nothing started while paused, nothing lost or run twice after)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Batch
from sqlalchemy import text

from backfill.adapters.clock import ManualClock
from backfill.domain.priority import DEFAULT_MAX_PRIORITY
from tests.integration.test_spend_caps import sdk
from tests.support import FAST, InProcess, backfill_on, chat_line, eventually, jsonl
from tests.support.in_process import Attempt


async def error_of(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["error"]
    return body


async def test_a_priority_is_given_at_creation_within_the_orgs_cap(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, replace(FAST)) as (bf, _):
        # Slow lines: the file stays in use (a batch's input goes when its batch ends).
        rows = [chat_line(f"x{i}", "[[sim:delay_ms=5000]]") for i in range(2)]
        uploaded = (await bf.upload(jsonl(rows))).json()["id"]
        made = await bf.create(uploaded, priority=5)
        assert made.status_code == 200, made.text
        assert made.json()["priority"] == 5
        assert made.json()["paused_at"] is None

        over = await bf.create(uploaded, priority=DEFAULT_MAX_PRIORITY + 1)
        assert over.status_code == 400
        error = await error_of(over)
        assert (error["code"], error["param"]) == ("priority_too_high", "priority")
        assert f"at most {DEFAULT_MAX_PRIORITY}" in error["message"]
        assert "administrator can raise the cap" in error["message"]

        for bad in ("high", True, 1.5):
            refused = await bf.create(uploaded, priority=bad)
            assert refused.status_code == 400, bad
            assert (await error_of(refused))["param"] == "priority"
        low = await bf.create(uploaded, priority=-101)
        assert low.status_code == 400
        assert "lowest priority is -100" in (await error_of(low))["message"]
        assert (await bf.create(uploaded, priority=-100)).json()["priority"] == -100

        # The administrator raises the cap: the same priority is taken.
        org = await bf.backfill.services.controls.update_org("default", {"max_priority": 20})
        assert org.max_priority == 20
        assert (await bf.create(uploaded, priority=15)).json()["priority"] == 15


async def test_a_running_batchs_priority_changes_and_an_ended_one_is_refused(
    tmp_path: Path,
) -> None:
    async with backfill_on(tmp_path, replace(FAST)) as (bf, _):
        slow = await bf.submit([chat_line(f"s{i}", "slow [[sim:delay_ms=2000]]") for i in range(2)])
        path = f"/v1/batches/{slow['id']}"
        changed = await bf.client.post(path, json={"priority": 3})
        assert changed.status_code == 200, changed.text
        assert changed.json()["priority"] == 3
        assert (await bf.batch(slow["id"]))["priority"] == 3

        unknown = await bf.client.post(path, json={"priority": 1, "metadata": {}})
        assert unknown.status_code == 400
        assert (await error_of(unknown))["code"] == "unknown_parameter"
        missing = await bf.client.post(path, json={})
        assert (await error_of(missing))["code"] == "missing_required_parameter"
        capped = await bf.client.post(path, json={"priority": 11})
        assert (await error_of(capped))["code"] == "priority_too_high"
        absent = await bf.client.post("/v1/batches/batch_nope", json={"priority": 1})
        assert absent.status_code == 404

        done = await bf.run_batch([chat_line("d0")])
        ended = await bf.client.post(f"/v1/batches/{done['id']}", json={"priority": 1})
        assert ended.status_code == 409
        error = await error_of(ended)
        assert error["code"] == "batch_not_running"
        assert "is completed" in error["message"]
        for action in ("pause", "resume"):
            refused = await bf.client.post(f"/v1/batches/{done['id']}/{action}")
            assert refused.status_code == 409
            assert (await error_of(refused))["code"] == "batch_not_running"


# The big batch's lines take 40 ms each, 8 at a time: 200 a second, so its 20,000 lines would
# take 100 s; the test ends it once the others have shown what they do.
_LIMIT = 8
_PREFETCH = 2  # runner/slots.py: a quarter of the limit, at least MIN_PREFETCH


async def test_a_priority_10_batch_overtakes_a_20000_line_batch_of_its_org(
    tmp_path: Path,
) -> None:
    attempts: list[Attempt] = []
    async with backfill_on(
        tmp_path, replace(FAST), max_concurrency=_LIMIT, attempts=attempts, plan_interval_s=0.2
    ) as (bf, _):
        big = await bf.submit(
            [chat_line(f"a{i}", f"big {i} [[sim:delay_ms=40]]") for i in range(20_000)]
        )
        await eventually(
            lambda: bf.batch(big["id"]),
            lambda b: b["status"] == "in_progress" and b["request_counts"]["completed"] > 50,
            timeout_s=60,
            what="the big batch runs",
        )
        # Submitted together: one at priority 10, one at the default 0 (and a later deadline
        # than the big one's, so it is behind it).
        rows = [chat_line(f"u{i}", f"urgent {i}") for i in range(10)]
        same = [chat_line(f"l{i}", f"later {i}") for i in range(10)]
        files = [(await bf.upload(jsonl(lines))).json()["id"] for lines in (rows, same)]
        # From the moment it is asked for: what starts after can only be what the worker had
        # claimed, or was claiming, when it became claimable (created in_progress: its lines
        # are queued before the answer).
        asked_at = time.monotonic()
        made = await asyncio.gather(
            bf.create(files[0], priority=10), bf.create(files[1], completion_window="48h")
        )
        urgent, later = (answer.json() for answer in made)
        assert urgent["status"] == "in_progress"
        finished = await bf.wait(urgent["id"], timeout_s=30)
        assert finished["status"] == "completed"
        assert finished["request_counts"] == {"total": 10, "completed": 10, "failed": 0}

        # Overtaken within one claim cycle: of the big batch's lines, only those the worker
        # held or was claiming when the priority batch became claimable went first.
        last_urgent = max(a.started for a in attempts if a.prompt.startswith("urgent"))
        went_first = [
            a for a in attempts if a.prompt.startswith("big") and asked_at < a.started < last_urgent
        ]
        big_now = await bf.batch(big["id"])
        print(
            f"\npriority 10 behind 20,000 lines: {len(went_first)} of the big batch's lines "
            f"started after it was asked for; the big one had "
            f"{big_now['request_counts']['completed']:,} done when it completed"
        )
        assert len(went_first) <= 2 * (_LIMIT + _PREFETCH), len(went_first)
        assert big_now["request_counts"]["completed"] < 19_000

        # The priority-0 batch submitted at the same time waits behind the big one, and says
        # so: its org's batches that go first.
        waiting = await bf.batch(later["id"])
        assert waiting["request_counts"]["completed"] == 0
        shown = await eventually(
            lambda: bf.batch(later["id"]),
            lambda b: (b["waiting_on"] or {}).get("code") == "priority",
            what="the priority-0 batch says why it waits",
        )
        message = shown["waiting_on"]["message"]
        assert "1 other batch of this organization on model 'sim-model' goes first" in message
        assert "the earlier deadline goes first" in message
        assert not any(a.prompt.startswith("later") for a in attempts)

        # Raised above the big one, it goes next.
        raised = await bf.client.post(f"/v1/batches/{later['id']}", json={"priority": 1})
        assert raised.status_code == 200
        assert (await bf.wait(later["id"], timeout_s=30))["status"] == "completed"
        await bf.client.post(f"/v1/batches/{big['id']}/cancel")
        await bf.wait(big["id"], timeout_s=60)


async def test_a_paused_batch_starts_nothing_and_resumes_where_it_stopped(
    tmp_path: Path,
) -> None:
    attempts: list[Attempt] = []
    async with backfill_on(
        tmp_path, replace(FAST), max_concurrency=4, attempts=attempts, plan_interval_s=0.2
    ) as (bf, _):
        rows = [chat_line(f"r{i}", f"paused {i} [[sim:delay_ms=100]]") for i in range(60)]

        def ours() -> list[Attempt]:
            """This batch's requests: the engine's port may have served another test before,
            whose leftover client could still knock on it."""
            return [a for a in attempts if a.prompt.startswith("paused ")]

        batch = await bf.submit(rows)
        await eventually(
            lambda: bf.batch(batch["id"]),
            lambda b: b["request_counts"]["completed"] >= 8,
            what="the batch runs",
        )
        paused = (await bf.client.post(f"/v1/batches/{batch['id']}/pause")).json()
        assert paused["paused_at"] is not None
        assert paused["status"] == "in_progress"
        assert paused["waiting_on"]["code"] == "paused"
        assert "resume" in paused["waiting_on"]["message"]
        assert "window keeps running" in paused["waiting_on"]["message"]
        again = (await bf.client.post(f"/v1/batches/{batch['id']}/pause")).json()
        assert again["paused_at"] == paused["paused_at"], "pausing twice changes nothing"

        # What a worker had claimed (running, or waiting in it for a free slot) finishes;
        # then nothing starts while it is paused.
        async def leased() -> int:
            async with bf.backfill.store.engine.connect() as conn:
                found = await conn.execute(
                    text("SELECT count(*) FROM items WHERE batch_id = :b AND state = 1"),
                    {"b": batch["id"]},
                )
                return int(found.scalar_one())

        await eventually(leased, lambda n: n == 0, what="claimed lines finish")
        settled = await eventually(
            lambda: bf.batch(batch["id"]),
            lambda b: (
                b["request_counts"]["completed"] == len(ours()) and all(a.ended for a in ours())
            ),
            what="their answers are in",
        )
        before = len(ours())
        await asyncio.sleep(1.5)
        started = [(a.prompt.split(" [[")[0], round(a.started, 3)) for a in ours()[before:]]
        assert started == [], f"a paused batch started requests: {started}"
        held = await bf.batch(batch["id"])
        assert held["request_counts"]["completed"] == settled["request_counts"]["completed"]
        assert held["request_counts"]["completed"] < 60

        resumed = (await bf.client.post(f"/v1/batches/{batch['id']}/resume")).json()
        assert resumed["paused_at"] is None
        finished = await bf.wait(batch["id"], timeout_s=60)
        assert finished["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        out = await bf.rows(finished["output_file_id"])
        assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(60))
        # Each line ran once: a pause neither loses nor repeats one.
        assert len(ours()) == 60


async def test_the_openai_sdk_sets_a_priority_pauses_and_resumes(tmp_path: Path) -> None:
    """The official SDK unchanged: ``extra_body`` at creation, its generic ``post`` for the
    routes it has no method for, the batch object parsed as its own ``Batch``."""
    async with (
        backfill_on(tmp_path, replace(FAST), max_concurrency=1) as (bf, _),
        sdk(bf) as (client, _attempts),
    ):
        uploaded = await bf.upload(
            jsonl([chat_line(f"s{i}", f"sdk {i} [[sim:delay_ms=200]]") for i in range(8)])
        )
        batch = await client.batches.create(
            input_file_id=uploaded.json()["id"],
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"priority": 3},
        )
        assert batch.model_extra is not None
        assert batch.model_extra["priority"] == 3
        paused = await client.post(f"/batches/{batch.id}/pause", cast_to=Batch)
        assert paused.model_extra is not None
        assert paused.model_extra["paused_at"] is not None
        assert paused.model_extra["waiting_on"]["code"] == "paused"
        changed = await client.post(f"/batches/{batch.id}", body={"priority": 6}, cast_to=Batch)
        assert changed.model_extra is not None
        assert changed.model_extra["priority"] == 6
        with pytest.raises(openai.BadRequestError) as refused:
            await client.post(f"/batches/{batch.id}", body={"priority": 60}, cast_to=Batch)
        assert refused.value.code == "priority_too_high"
        await client.post(f"/batches/{batch.id}/resume", cast_to=Batch)
        done = await bf.wait(batch.id, timeout_s=60)
        assert done["request_counts"]["completed"] == 8


async def test_a_paused_batch_still_expires_and_its_unstarted_lines_are_not_charged(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    async with backfill_on(
        tmp_path, replace(FAST), max_concurrency=2, clock=clock, min_completion_window_s=60
    ) as (bf, _):
        org = await bf.backfill.store.org_by_name("default")
        assert org is not None
        before = await bf.backfill.services.billing.ledger(org.id)
        rows = [chat_line(f"e{i}", f"expiring {i}") for i in range(2)]
        rows += [chat_line(f"w{i}", f"[[sim:delay_ms=60000]] held {i}") for i in range(6)]
        batch = await bf.submit(rows, completion_window="1m")
        await eventually(
            lambda: bf.batch(batch["id"]),
            lambda b: b["request_counts"]["completed"] == 2,
            what="the quick lines finish",
        )
        paused = (await bf.client.post(f"/v1/batches/{batch['id']}/pause")).json()
        assert paused["waiting_on"]["code"] == "paused"
        clock.advance(61)
        ended = await bf.wait(batch["id"], timeout_s=30)
        assert ended["status"] == "expired"
        assert ended["request_counts"] == {"total": 8, "completed": 2, "failed": 6}
        errors = await bf.rows(ended["error_file_id"])
        assert {r["error"]["code"] for r in errors} == {"batch_expired"}
        # Charged the two answers only; the rest of the reservation went back.
        after = await bf.backfill.services.billing.ledger(org.id)
        assert after.reserved == before.reserved
        assert before.balance - after.balance == int(await charged(bf, batch["id"]))


async def charged(bf: InProcess, batch_id: str) -> int:
    async with bf.backfill.store.engine.connect() as conn:
        found = await conn.execute(
            text("SELECT coalesce(sum(amount), 0) FROM receipts WHERE batch_id = :b"),
            {"b": batch_id},
        )
        return int(found.scalar_one())
