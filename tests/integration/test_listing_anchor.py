"""``after=`` of GET /v1/files and /v1/batches resolves only ids of the caller's org (SPEC §3.3,
§4.4): another org's id gives the same 400 as an id that never existed, so a listing says
nothing about other orgs' objects."""

from __future__ import annotations

import re
from typing import Any

from tests.support import InProcess, chat_line, jsonl


async def other_org(bf: InProcess, name: str = "other") -> dict[str, str]:
    tenants = bf.backfill.services.tenants
    await tenants.create_org(name)
    await bf.backfill.services.billing.add_credit(name, "100")
    return {
        "Authorization": f"Bearer {await tenants.create_key(name, frozenset({'inference:write'}))}"
    }


async def upload(bf: InProcess, name: str, headers: dict[str, str] | None = None) -> str:
    response = await bf.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", jsonl([chat_line(name)]), "application/jsonl")},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


def anchor_error(response: Any, foreign: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "after")
    message: str = error["message"]
    # Everything but the echoed id is the same for a foreign id and an unknown one.
    return message.replace(foreign, "ID")


async def test_files_after_an_id_of_another_org_is_like_an_unknown_id(
    backfill: InProcess,
) -> None:
    theirs = await other_org(backfill)
    b1 = await upload(backfill, "b1")
    foreign = await upload(backfill, "a1", theirs)
    b2 = await upload(backfill, "b2")

    async def page(**params: Any) -> Any:
        return await backfill.client.get("/v1/files", params=params)

    unknown = "file-" + "0" * 24
    for order in ("desc", "asc"):
        told = anchor_error(await page(after=foreign, order=order), foreign)
        assert told == anchor_error(await page(after=unknown, order=order), unknown)
    assert anchor_error(await page(after="x\x00" * 100), "never-echoed")
    # An anchor of one's own still pages, deleted or not.
    assert [f["id"] for f in (await page(after=b2)).json()["data"]] == [b1]
    assert (await backfill.client.delete(f"/v1/files/{b2}")).status_code == 200
    assert [f["id"] for f in (await page(after=b2)).json()["data"]] == [b1]
    assert [f["id"] for f in (await page(after=b1, order="asc")).json()["data"]] == []


async def test_batches_after_an_id_of_another_org_is_like_an_unknown_id(
    backfill: InProcess,
) -> None:
    theirs = await other_org(backfill)
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    mine = await backfill.create(await upload(backfill, "b1"))
    assert mine.status_code == 200, mine.text
    foreign = await backfill.client.post(
        "/v1/batches",
        json={"input_file_id": await upload(backfill, "a1", theirs), **body},
        headers=theirs,
    )
    assert foreign.status_code == 200, foreign.text
    foreign_id = foreign.json()["id"]

    async def page(after: str) -> Any:
        return await backfill.client.get("/v1/batches", params={"after": after})

    unknown = re.sub(r"[0-9a-f]", "0", foreign_id)
    told = anchor_error(await page(foreign_id), foreign_id)
    assert told == anchor_error(await page(unknown), unknown)
    own = await page(mine.json()["id"])
    assert own.status_code == 200
    assert own.json()["data"] == []
