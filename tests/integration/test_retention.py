"""Retention (SPEC §10.3), driven by a ManualClock: the janitor deletes expired content."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import func, select

from backfill.adapters.db import tables
from tests.support import InProcess, chat_line, jsonl, retained

HOUR = 3600
DAY = 24 * HOUR


def _blob_files(bf: InProcess) -> set[str]:
    root = bf.settings.data_dir / "blobs" / "files"
    return {p.name for p in root.iterdir()} if root.exists() else set()


async def _results_kept(bf: InProcess, batch_id: str) -> int:
    items = tables.items
    async with bf.backfill.store.engine.connect() as conn:
        count = (
            await conn.execute(
                select(func.count())
                .select_from(items)
                .where(items.c.batch_id == batch_id, items.c.result.is_not(None))
            )
        ).scalar_one()
    return int(count)


async def test_unused_input_expires_24h_after_upload(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        file = (await bf.upload(jsonl([chat_line("a")]))).json()
        assert file["expires_at"] == file["created_at"] + DAY
        clock.advance(DAY - 10)
        assert await janitor.sweep() == 0
        clock.advance(20)
        assert await janitor.sweep() == 1
        assert (await bf.client.get(f"/v1/files/{file['id']}")).status_code == 404
        assert not any(name.startswith(file["id"]) for name in _blob_files(bf))


async def test_expires_after_shortens_input_retention(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        response = await bf.client.post(
            "/v1/files",
            data={
                "purpose": "batch",
                "expires_after[anchor]": "created_at",
                "expires_after[seconds]": "3600",
            },
            files={"file": ("in.jsonl", jsonl([chat_line("a")]), "application/jsonl")},
        )
        file = response.json()
        assert file["expires_at"] == file["created_at"] + HOUR
        clock.advance(HOUR + 1)
        assert await janitor.sweep() == 1


async def test_accepted_input_is_removed_after_completion(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, _, janitor):
        batch = await bf.run_batch([chat_line("a"), chat_line("b")])
        assert batch["status"] == "completed"
        assert await janitor.sweep() == 1  # the input, not the results
        assert (await bf.client.get(f"/v1/files/{batch['input_file_id']}")).status_code == 404
        assert (await bf.client.get(f"/v1/files/{batch['output_file_id']}")).status_code == 200


async def test_accepted_input_is_gone_within_48h_of_acceptance(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        file = (await bf.upload(jsonl([chat_line("slow", "[[sim:hang]]")]))).json()
        batch = (await bf.create(file["id"])).json()
        assert await janitor.sweep() == 0, "the input of an unfinished batch is kept"
        clock.advance(DAY + 1)  # the window ends: the batch expires and finalizes
        finished = await bf.wait(batch["id"])
        assert finished["status"] == "expired"
        clock.advance(DAY - 2)  # still inside 48h of acceptance
        await janitor.sweep()
        assert (await bf.client.get(f"/v1/files/{file['id']}")).status_code == 404


async def test_results_expire_7_days_after_the_batch_ends(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        batch = await bf.run_batch([chat_line("a"), chat_line("bad", "[[sim:status=400]]")])
        await janitor.sweep()  # the input
        assert await _results_kept(bf, batch["id"]) == 2
        clock.advance(7 * DAY - 10)
        assert await janitor.sweep() == 0
        clock.advance(20)
        assert await janitor.sweep() == 2
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            assert (await bf.client.get(f"/v1/files/{file_id}")).status_code == 404
        assert _blob_files(bf) == set()
        assert await _results_kept(bf, batch["id"]) == 0


async def test_output_expires_after_shortens_result_retention(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, clock, janitor):
        file = (await bf.upload(jsonl([chat_line("a")]))).json()
        created = await bf.create(
            file["id"], output_expires_after={"anchor": "created_at", "seconds": 7200}
        )
        assert created.status_code == 200, created.text
        batch = await bf.wait(created.json()["id"])
        output = (await bf.client.get(f"/v1/files/{batch['output_file_id']}")).json()
        assert output["expires_at"] == output["created_at"] + 7200
        clock.advance(7201)
        assert await janitor.sweep() == 3  # input, output and error files


async def test_deleting_a_result_file_purges_per_request_results(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, _, _janitor):
        batch = await bf.run_batch([chat_line("a"), chat_line("b")])
        assert await _results_kept(bf, batch["id"]) == 2
        deleted = await bf.client.delete(f"/v1/files/{batch['output_file_id']}")
        assert deleted.json() == {"id": batch["output_file_id"], "object": "file", "deleted": True}
        assert await _results_kept(bf, batch["id"]) == 0
        assert not any(name.startswith(batch["output_file_id"]) for name in _blob_files(bf))


async def test_bad_output_expires_after_is_rejected(tmp_path: Path) -> None:
    async with retained(tmp_path) as (bf, _, _janitor):
        file = (await bf.upload(jsonl([chat_line("a")]))).json()
        response = await bf.create(file["id"], output_expires_after={"anchor": "x", "seconds": 1})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "output_expires_after"
