"""Catalog prices, credit, settlement at real usage, receipts (SPEC §6.4, §7.2, §7.3)."""

from __future__ import annotations

from pathlib import Path

from backfill.domain.catalog import CatalogModel
from backfill.domain.money import Prices, token_charge, usd_to_pico
from backfill.simulator.server import SimulatorConfig
from tests.support import SIM_MODEL, InProcess, chat_line, in_process_backfill, running_simulator

EXAMPLE = (
    b'{"custom_id":"q1","method":"POST","url":"/v1/chat/completions","body":{"model":"sim-model",'
    b'"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":100}}\n'
    b'{"custom_id":"q2","method":"POST","url":"/v1/chat/completions","body":{"model":"sim-model",'
    b'"messages":[{"role":"user","content":"Name a color."}],"max_tokens":50}}\n'
)


async def _org_id(bf: InProcess) -> str:
    org = await bf.backfill.store.org_by_name("default")
    assert org is not None
    return org.id


async def test_worked_example_of_docs_billing(tmp_path: Path) -> None:
    config = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=64)
    async with (
        running_simulator(config) as (url, _),
        in_process_backfill(tmp_path, url) as bf,
    ):
        org_id = await _org_id(bf)
        before = await bf.backfill.store.ledger(org_id)
        uploaded = (await bf.upload(EXAMPLE)).json()
        created = (await bf.create(uploaded["id"])).json()
        assert created["billing"] == "catalog"
        assert created["pricing"] == {
            "unit": "microusd_per_million_tokens",
            "input": "100000",
            "cached_input": "50000",
            "output": "400000",
        }
        batch = await bf.wait(created["id"])
        assert batch["status"] == "completed"
        rows = {r["custom_id"]: r for r in await bf.rows(batch["output_file_id"])}
        amounts = {}
        for custom_id, row in rows.items():
            receipt = (await bf.client.get(f"/v1/receipts/{row['response']['request_id']}")).json()
            assert receipt["custom_id"] == custom_id
            assert receipt["batch_id"] == batch["id"]
            amounts[custom_id] = int(receipt["amount"]["value"])
        assert amounts == {"q1": 25_900_000, "q2": 20_300_000}
        after = await bf.backfill.store.ledger(org_id)
        assert before.balance - after.balance == 46_200_000
        assert after.reserved == 0
        assert after.balance == after.credits - after.charges
        assert batch["usage"]["input_tokens"] == 6
        assert batch["usage"]["output_tokens"] == 114


async def test_reservation_is_the_worst_case_of_the_file(tmp_path: Path) -> None:
    # No engine: nothing settles, so the whole reservation of the docs' example is visible.
    async with in_process_backfill(tmp_path, "http://127.0.0.1:9/v1", engines=[]) as bf:
        uploaded = (await bf.upload(EXAMPLE)).json()
        created = await bf.create(uploaded["id"])
        assert created.status_code == 200, created.text
        ledger = await bf.backfill.store.ledger(await _org_id(bf))
        assert ledger.reserved == 95_800_000


async def test_usage_equals_the_sum_of_output_rows(backfill: InProcess) -> None:
    rows = [chat_line(f"r{i}", " ".join(["word"] * (i + 1))) for i in range(12)]
    rows.append(chat_line("bad", "[[sim:status=400]]"))
    batch = await backfill.run_batch(rows)
    out = await backfill.rows(batch["output_file_id"])
    usage = batch["usage"]
    assert usage["input_tokens"] == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in out
    )
    assert usage["output_tokens"] == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in out
    )
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    errors = await backfill.rows(batch["error_file_id"])
    receipt = await backfill.client.get(f"/v1/receipts/{errors[0]['response']['request_id']}")
    assert receipt.status_code == 404, "a failed request is never charged"


async def test_price_change_mid_batch_keeps_accepted_prices(backfill: InProcess) -> None:
    rows = [chat_line(f"p{i}", "[[sim:delay_ms=300]] hello") for i in range(40)]
    uploaded = (await backfill.upload(b"".join(_line(r) for r in rows))).json()
    created = (await backfill.create(uploaded["id"])).json()
    await backfill.backfill.services.catalog.put(
        CatalogModel(
            id=SIM_MODEL,
            model_config_id="sim-model-v1",
            context_length=4096,
            max_output_tokens=1024,
            prices=Prices(999_999, 999_999, 999_999),
        )
    )
    batch = await backfill.wait(created["id"])
    assert batch["pricing"]["output"] == "400000"
    old = Prices(100_000, 50_000, 400_000)
    for row in await backfill.rows(batch["output_file_id"]):
        receipt = (
            await backfill.client.get(f"/v1/receipts/{row['response']['request_id']}")
        ).json()
        usage = receipt["usage"]
        assert receipt["pricing"]["input"] == "100000"
        expected = token_charge(old, usage["input_tokens"], 0, usage["output_tokens"])
        assert int(receipt["amount"]["value"]) == expected
    # New work is priced at the new prices (the accepted input went with its batch).
    reuploaded = (await backfill.upload(b"".join(_line(r) for r in rows))).json()
    again = (await backfill.create(reuploaded["id"])).json()
    assert again["pricing"]["input"] == "999999"
    await backfill.wait(again["id"])


def _line(row: dict[str, object]) -> bytes:
    import orjson

    return orjson.dumps(row) + b"\n"


async def test_models_endpoint_shows_batch_entries(tmp_path: Path) -> None:
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url) as bf,
    ):
        await bf.backfill.services.catalog.put(
            CatalogModel(
                id="chat-only",
                model_config_id="chat-only-1",
                context_length=1024,
                max_output_tokens=256,
            )
        )
        models = {m["id"]: m for m in (await bf.client.get("/v1/models")).json()["data"]}
        assert models["chat-only"]["batch"] is None
        assert models[SIM_MODEL]["batch"]["pricing"]["output"] == "400000"
        assert models[SIM_MODEL]["model_config_id"] == "sim-model-v1"
        rejected = await bf.upload(_line(chat_line("x", model="chat-only")))
        assert rejected.status_code == 400
        error = rejected.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["line"] == 1
        assert "body.model" in error["message"]


async def test_admin_credit_and_ledger_over_http(tmp_path: Path) -> None:
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url, admin_token="admin-secret") as bf,
    ):
        admin = {"Authorization": "Bearer admin-secret"}
        denied = await bf.client.post("/admin/v1/credits", json={"org": "default", "usd": "1"})
        assert denied.status_code == 401
        added = await bf.client.post(
            "/admin/v1/credits", json={"org": "default", "usd": "2.5"}, headers=admin
        )
        assert added.status_code == 200, added.text
        assert added.json()["balance"] == "1002.5"
        put = await bf.client.put(
            "/admin/v1/models/new-model",
            json={"model_config_id": "new-1", "batch": {"input": 1, "output": 2}},
            headers=admin,
        )
        assert put.json()["batch"]["pricing"]["cached_input"] == "1"
        ledger = (await bf.client.get("/admin/v1/orgs/default/ledger", headers=admin)).json()
        assert ledger["credits"] == "1002.5"
        assert ledger["available"] == "1002.5"
        assert usd_to_pico("1002.5") == 1_002_500_000_000_000
        engines = (await bf.client.get("/admin/v1/engines", headers=admin)).json()["data"]
        assert [e["id"] for e in engines] == ["sim"]
