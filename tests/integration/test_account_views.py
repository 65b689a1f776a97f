"""What a key reads about itself and its org (``/v1/api_key``, ``/v1/organization``, its
ledger, batch charges, error codes) and the admin views (``/admin/v1/orgs``,
``/admin/v1/queue``): right for the caller, and never another org's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.domain.money import usd_to_pico
from backfill.services.tenants import READ, SCOPES, WRITE
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import (
    InProcess,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
    wait_terminal,
)

ADMIN_TOKEN = "admin-token-for-the-account-views"
# Over the engine slots of in_process_backfill (32): a batch this long always has lines waiting.
LINES_PAST_SLOTS = 80


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
async def bf(tmp_path: Path, sim: tuple[str, Simulator]) -> AsyncIterator[InProcess]:
    async with in_process_backfill(tmp_path, sim[0], admin_token=ADMIN_TOKEN) as running:
        yield running


async def other_org(bf: InProcess, name: str = "other", credit: str = "5") -> str:
    """Org ``name`` with ``credit`` USD and a key with both scopes; returns the key."""
    await bf.backfill.services.tenants.create_org(name)
    await bf.backfill.services.billing.credit(name, credit, "other's top-up")
    return await bf.backfill.services.tenants.create_key(name, SCOPES)


async def run_as(bf: InProcess, key: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    uploaded = await bf.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
        headers=bearer(key),
    )
    assert uploaded.status_code == 200, uploaded.text
    created = await bf.client.post(
        "/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions"},
        headers=bearer(key),
    )
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    return await wait_terminal(bf.client, batch_id, headers=bearer(key), timeout_s=60)


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    found: dict[str, Any] = response.json()["error"]
    assert found["message"]
    return found


# ---- the key's identity -----------------------------------------------------------------


async def test_a_key_reads_its_scopes_and_org(bf: InProcess) -> None:
    answer = await bf.client.get("/v1/api_key")
    assert answer.status_code == 200, answer.text
    key = answer.json()
    assert key["object"] == "api_key"
    assert key["scopes"] == sorted(SCOPES)
    assert key["organization"]["name"] == "default"
    assert bf.key.startswith(key["prefix"])
    # The secret itself is never echoed.
    assert bf.key not in answer.text

    reader = await bf.backfill.services.tenants.new_key("default", frozenset({READ}), "viewer")
    answer = await bf.client.get("/v1/api_key", headers=bearer(reader.secret))
    assert answer.json()["scopes"] == [READ]
    assert answer.json()["name"] == "viewer"
    assert answer.json()["id"] == reader.key.id


async def test_a_bad_or_revoked_key_is_refused(bf: InProcess) -> None:
    assert error(await bf.client.get("/v1/api_key", headers=bearer("bf-nope")), 401)["code"] == (
        "invalid_api_key"
    )
    made = await bf.backfill.services.tenants.new_key("default", SCOPES)
    await bf.backfill.services.tenants.revoke_key(made.key.id)
    refused = error(await bf.client.get("/v1/api_key", headers=bearer(made.secret)), 401)
    assert refused["code"] == "revoked_api_key"
    # The admin token is no API key.
    assert error(await bf.client.get("/v1/api_key", headers=bearer(ADMIN_TOKEN)), 401)


# ---- the org's credit and ledger ----------------------------------------------------------


async def test_credit_and_ledger_follow_a_batch(bf: InProcess) -> None:
    batch = await bf.run_batch([chat_line("a"), chat_line("b")])
    assert batch["status"] == "completed"

    org = (await bf.client.get("/v1/organization")).json()
    assert org["object"] == "organization"
    assert org["name"] == "default"
    credit = org["credit"]
    ledger = await bf.backfill.services.billing.ledger(org["id"])
    assert usd_to_pico(credit["balance"]) == ledger.balance
    # Derived from the credits and the balance, it is what summing every receipt gives.
    assert usd_to_pico(credit["charges"]) == ledger.charges > 0
    assert usd_to_pico(credit["credits"]) == ledger.credits
    assert credit["reserved"] == "0"
    assert credit["available"] == credit["balance"]

    entries = (await bf.client.get("/v1/organization/ledger")).json()
    # Newest first: the batch was made after the starting credit.
    assert [e["type"] for e in entries["data"]] == ["batch", "credit"]
    charge, top_up = entries["data"]
    assert charge["batch_id"] == batch["id"]
    assert charge["batch_status"] == "completed"
    assert int(charge["amount"]["value"]) == -ledger.charges
    assert charge["reserved"]["value"] == "0"
    assert top_up["note"] == "starting credit"
    assert int(top_up["amount"]["value"]) == ledger.credits
    assert entries["has_more"] is False


async def test_the_ledger_pages_with_after(bf: InProcess) -> None:
    for amount in ("1", "2", "3"):
        await bf.backfill.services.billing.credit("default", amount, f"top-up {amount}")
    everything = (await bf.client.get("/v1/organization/ledger?limit=100")).json()["data"]
    assert len(everything) == 4
    seen: list[str] = []
    after: str | None = None
    while True:
        query = "/v1/organization/ledger?limit=1" + (f"&after={after}" if after else "")
        page = (await bf.client.get(query)).json()
        seen += [e["id"] for e in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == [e["id"] for e in everything]
    assert error(await bf.client.get("/v1/organization/ledger?limit=0"), 400)["param"] == "limit"
    assert error(await bf.client.get("/v1/organization/ledger?limit=101"), 400)["param"] == "limit"
    unknown = await bf.client.get("/v1/organization/ledger?after=cr_unknown")
    assert error(unknown, 400)["param"] == "after"


async def test_charges_of_a_running_batch_show_its_reservation(tmp_path: Path) -> None:
    slow = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4)
    async with (
        running_simulator(slow) as (url, _),
        in_process_backfill(tmp_path, url) as bf,
    ):
        # Long enough for the reads below, under the engine timeout (5 s): cancel waits for them.
        rows = [chat_line(f"r{i}", "[[sim:delay_ms=4500]]") for i in range(2)]
        uploaded = await bf.upload(jsonl(rows))
        created = (await bf.create(uploaded.json()["id"])).json()
        answer = await bf.client.get(f"/v1/organization/batch_charges?ids={created['id']}")
        (charges,) = answer.json()["data"]
        assert charges["object"] == "batch.charges"
        assert charges["billing"] == "catalog"
        assert int(charges["reserved"]["value"]) > 0
        assert charges["charged"]["value"] == "0"
        entries = (await bf.client.get("/v1/organization/ledger")).json()["data"]
        (entry,) = [e for e in entries if e["batch_id"] == created["id"]]
        assert entry["reserved"] == charges["reserved"]
        assert entry["amount"]["value"] == "0"
        await bf.client.post(f"/v1/batches/{created['id']}/cancel")
        ended = await bf.wait(created["id"])
        answer = await bf.client.get(f"/v1/organization/batch_charges?ids={created['id']}")
        assert answer.json()["data"][0]["reserved"]["value"] == "0"
        assert answer.json()["data"][0]["status"] == ended["status"] == "cancelled"


async def test_batch_charges_keep_the_order_asked_for(bf: InProcess) -> None:
    first = await bf.run_batch([chat_line("a")])
    second = await bf.run_batch([chat_line("b")])
    asked = f"{second['id']},batch_unknown,{first['id']},{second['id']}"
    answer = (await bf.client.get(f"/v1/organization/batch_charges?ids={asked}")).json()
    assert [c["id"] for c in answer["data"]] == [second["id"], first["id"]]
    assert all(int(c["charged"]["value"]) > 0 for c in answer["data"])


async def test_batch_charges_name_at_most_a_hundred_batches(bf: InProcess) -> None:
    many = ",".join(f"batch_{i}" for i in range(101))
    answer = await bf.client.get(f"/v1/organization/batch_charges?ids={many}")
    assert error(answer, 400)["param"] == "ids"
    empty = await bf.client.get("/v1/organization/batch_charges")
    assert empty.json()["data"] == []


# ---- error codes --------------------------------------------------------------------------


async def test_error_codes_count_the_failed_lines(bf: InProcess) -> None:
    rows = [
        chat_line("ok-1"),
        chat_line("bad-1", "[[sim:status=400]]"),
        chat_line("bad-2", "[[sim:status=400]] again"),
        chat_line("ok-2"),
    ]
    batch = await bf.run_batch(rows)
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    found = (await bf.client.get(f"/v1/batches/{batch['id']}/error_codes")).json()
    assert found["object"] == "batch.error_codes"
    assert found["data"] == [{"code": "http_400", "count": 2}]
    # Only the failed lines' rows are read.
    assert found["rows_read"] == 2
    assert found["complete"] is True
    assert found["truncated"] is False
    missing = await bf.client.get("/v1/batches/batch_nope/error_codes")
    assert error(missing, 404)


async def test_error_codes_stop_at_their_bound_and_say_so(bf: InProcess) -> None:
    rows = [chat_line(f"bad-{i}", "[[sim:status=503]]") for i in range(3)] + [chat_line("ok")]
    batch = await bf.run_batch(rows)
    org_id = (await bf.client.get("/v1/organization")).json()["id"]
    count = bf.backfill.services.error_codes.count
    cut = await count(org_id, batch["id"], max_rows=2)
    assert (cut.read, cut.truncated, cut.complete) == (2, True, False)
    assert sum(cut.counts.values()) == 2
    exact = await count(org_id, batch["id"], max_rows=3)
    assert (exact.read, exact.truncated, exact.complete) == (3, False, True)
    assert set(exact.counts) <= {"http_503", "request_timeout", "engine_unavailable"}


async def test_error_codes_of_removed_results_are_gone(bf: InProcess) -> None:
    batch = await bf.run_batch([chat_line("ok"), chat_line("bad", "[[sim:status=400]]")])
    deleted = await bf.client.delete(f"/v1/files/{batch['output_file_id']}")
    assert deleted.status_code == 200, deleted.text
    gone = error(await bf.client.get(f"/v1/batches/{batch['id']}/error_codes"), 410)
    assert gone["code"] == "results_removed"


async def test_cancelled_lines_count_as_batch_cancelled(tmp_path: Path) -> None:
    async with running_simulator() as (url, _), in_process_backfill(tmp_path, url) as bf:
        # More lines than the engine takes at once: some are never started, whatever the
        # timing; the ones under way when the cancel comes end by themselves, successfully.
        rows = [chat_line(f"r{i}", "[[sim:delay_ms=2000]]") for i in range(LINES_PAST_SLOTS)]
        uploaded = await bf.upload(jsonl(rows))
        created = (await bf.create(uploaded.json()["id"])).json()
        await bf.client.post(f"/v1/batches/{created['id']}/cancel")
        ended = await bf.wait(created["id"])
        found = (await bf.client.get(f"/v1/batches/{created['id']}/error_codes")).json()
        codes = {row["code"]: row["count"] for row in found["data"]}
        never_run = LINES_PAST_SLOTS - ended["request_counts"]["completed"]
        assert never_run > 0
        assert codes == {"batch_cancelled": never_run}


async def test_org_reads_need_requests_read_which_write_includes(bf: InProcess) -> None:
    # inference:write includes reading (SPEC §7.1): a key with only that scope reads them.
    writer = await bf.backfill.services.tenants.new_key("default", frozenset({WRITE}))
    for path in (
        "/v1/api_key",
        "/v1/organization",
        "/v1/organization/ledger",
        "/v1/organization/batch_charges",
    ):
        answer = await bf.client.get(path, headers=bearer(writer.secret))
        assert answer.status_code == 200, (path, answer.text)


# ---- another org's data is never visible --------------------------------------------------


async def test_another_orgs_data_stays_out_of_sight(bf: InProcess) -> None:
    theirs_key = await other_org(bf)
    theirs = await run_as(bf, theirs_key, [chat_line("x"), chat_line("y", "[[sim:status=400]]")])
    ours = await bf.run_batch([chat_line("a")])

    # Their key sees their org, ours sees ours.
    them = (await bf.client.get("/v1/api_key", headers=bearer(theirs_key))).json()
    assert them["organization"]["name"] == "other"
    assert (await bf.client.get("/v1/organization")).json()["name"] == "default"

    # Charges: their batch is left out of our answer, as an unknown id is.
    answer = await bf.client.get(
        f"/v1/organization/batch_charges?ids={theirs['id']},{ours['id']},batch_unknown"
    )
    assert [c["id"] for c in answer.json()["data"]] == [ours["id"]]

    # Error codes of their batch: 404, as for a batch that does not exist.
    assert error(await bf.client.get(f"/v1/batches/{theirs['id']}/error_codes"), 404)

    # Our ledger holds none of their entries, and their entry ids are no cursor for us.
    ours_ledger = (await bf.client.get("/v1/organization/ledger?limit=100")).json()["data"]
    their_ledger = (
        await bf.client.get("/v1/organization/ledger?limit=100", headers=bearer(theirs_key))
    ).json()["data"]
    assert {e["id"] for e in ours_ledger}.isdisjoint({e["id"] for e in their_ledger})
    assert theirs["id"] in {e["batch_id"] for e in their_ledger}
    for entry in their_ledger:
        refused = await bf.client.get(f"/v1/organization/ledger?after={entry['id']}")
        assert error(refused, 400)["param"] == "after"
    their_credit = (await bf.client.get("/v1/organization", headers=bearer(theirs_key))).json()
    assert their_credit["credit"]["credits"] == "5"


# ---- admin views -------------------------------------------------------------------------


async def test_admin_lists_orgs_with_their_credit(bf: InProcess) -> None:
    await other_org(bf, "acme", "12.5")
    await other_org(bf, "zeta", "1")
    admin = bearer(ADMIN_TOKEN)
    listed = (await bf.client.get("/admin/v1/orgs?limit=100", headers=admin)).json()
    by_name = {o["name"]: o for o in listed["data"]}
    # Oldest first; orgs made in the same second follow their ids.
    assert [(o["created_at"], o["id"]) for o in listed["data"]] == sorted(
        (o["created_at"], o["id"]) for o in listed["data"]
    )
    assert set(by_name) == {"default", "acme", "zeta"}
    assert by_name["acme"]["credit"] == {
        "unit": "usd",
        "balance": "12.5",
        "reserved": "0",
        "available": "12.5",
    }
    assert by_name["default"]["object"] == "organization"

    names: list[str] = []
    after: str | None = None
    while True:
        query = "/admin/v1/orgs?limit=2" + (f"&after={after}" if after else "")
        page = (await bf.client.get(query, headers=admin)).json()
        names += [o["name"] for o in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert names == [o["name"] for o in listed["data"]]
    unknown = await bf.client.get("/admin/v1/orgs?after=org_unknown", headers=admin)
    assert error(unknown, 400)["param"] == "after"


async def test_admin_views_need_the_admin_token(bf: InProcess) -> None:
    for path in ("/admin/v1/orgs", "/admin/v1/queue"):
        # An org's key is no admin token.
        assert error(await bf.client.get(path), 401)["code"] == "invalid_admin_token"


async def test_admin_sees_the_queue_by_model(tmp_path: Path) -> None:
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url, admin_token=ADMIN_TOKEN) as bf,
    ):
        admin = bearer(ADMIN_TOKEN)
        assert (await bf.client.get("/admin/v1/queue", headers=admin)).json()["data"] == []
        rows = [chat_line(f"r{i}", "[[sim:delay_ms=4500]]") for i in range(3)]
        uploaded = await bf.upload(jsonl(rows))
        created = (await bf.create(uploaded.json()["id"])).json()

        async def read_queue() -> list[dict[str, Any]]:
            data: list[dict[str, Any]] = (
                await bf.client.get("/admin/v1/queue", headers=admin)
            ).json()["data"]
            return data

        queue = await eventually(
            read_queue,
            lambda queue: bool(queue) and queue[0]["in_progress"] == 1,
            30,
            what="a request of the batch in progress",
            interval_s=0.05,
        )
        (model,) = queue
        assert model["model"] == "sim-model"
        assert model["batches"] == 1
        assert model["remaining_requests"] == 3
        await bf.client.post(f"/v1/batches/{created['id']}/cancel")
        await bf.wait(created["id"])
        assert (await bf.client.get("/admin/v1/queue", headers=admin)).json()["data"] == []


# ---- the page itself ---------------------------------------------------------------------


async def anonymous_get(bf: InProcess, path: str, **headers: str) -> httpx.Response:
    """GET without any Authorization header."""
    request = bf.client.build_request("GET", path, headers=headers)
    del request.headers["Authorization"]
    return await bf.client.send(request)


async def test_the_page_is_served_without_a_key_and_with_strict_headers(bf: InProcess) -> None:
    page = await anonymous_get(bf, "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-frame-options"] == "DENY"
    # The one script is a module file of this origin: nothing inline.
    assert page.text.count("<script") == 1
    assert '<script type="module" src="/dashboard/app.js"></script>' in page.text

    script = await anonymous_get(bf, "/dashboard/app.js")
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert script.headers["x-content-type-options"] == "nosniff"
    again = await anonymous_get(
        bf, "/dashboard/app.js", **{"If-None-Match": script.headers["etag"]}
    )
    assert again.status_code == 304

    for missing in ("/dashboard/nope.js", "/dashboard/..%2Fdashboard.py"):
        assert error(await anonymous_get(bf, missing), 404)["code"] == "not_found"
