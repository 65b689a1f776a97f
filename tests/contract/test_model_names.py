"""The catalog's names on every store (SQLite and PostgreSQL): each entry's id and aliases are
stored with it, and one name means one model whatever writers race (docs/api.md, "Model
aliases")."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from backfill.adapters.db.store import SqlStore
from backfill.domain.catalog import CatalogModel
from backfill.domain.money import Prices
from backfill.errors import BackfillError, Conflict, InvalidInput
from tests.contract.test_store import make_org

QWEN = CatalogModel(
    "Qwen/Qwen2.5-7B-Instruct",
    "qwen-v1",
    4096,
    256,
    prices=Prices(1, 1, 1),
    aliases=frozenset({"qwen-7b", "gpt-4o-mini"}),
)
LLAMA = CatalogModel("meta/llama", "llama-v1", 4096, 256, prices=Prices(1, 1, 1))


async def models(store: SqlStore) -> dict[str, CatalogModel]:
    return {m.id: m for m in await store.list_models()}


async def test_aliases_are_stored_with_their_model(store: SqlStore) -> None:
    assert await store.upsert_model(QWEN, 1, replace=True) is None
    assert await store.upsert_model(LLAMA, 1, replace=True) is None
    assert await models(store) == {QWEN.id: QWEN, LLAMA.id: LLAMA}
    # A change replaces the aliases: a dropped one is free for another model at once.
    fewer = dataclasses.replace(QWEN, aliases=frozenset({"qwen-7b", "qwen"}))
    assert await store.upsert_model(fewer, 2, replace=True) == QWEN
    llama = dataclasses.replace(LLAMA, aliases=frozenset({"gpt-4o-mini"}))
    assert await store.upsert_model(llama, 2, replace=True) == LLAMA
    assert await models(store) == {QWEN.id: fewer, LLAMA.id: llama}


@pytest.mark.parametrize(
    ("taking", "error", "code"),
    [
        # An alias that is another model's alias, or its id.
        (dataclasses.replace(LLAMA, aliases=frozenset({"qwen-7b"})), InvalidInput, "alias_taken"),
        (dataclasses.replace(LLAMA, aliases=frozenset({QWEN.id})), InvalidInput, "alias_taken"),
        # A new entry whose id is another model's alias, public or private.
        (dataclasses.replace(LLAMA, id="gpt-4o-mini"), Conflict, "model_id_taken"),
        (
            CatalogModel("qwen-7b", "dep-v1", 4096, 256, owner_org_id="", gpu_count=1),
            Conflict,
            "model_id_taken",
        ),
    ],
)
async def test_a_name_another_entry_holds_is_refused_and_nothing_is_written(
    store: SqlStore, taking: CatalogModel, error: type[BackfillError], code: str
) -> None:
    if taking.owner_org_id is not None:
        taking = dataclasses.replace(taking, owner_org_id=(await make_org(store)).id)
    await store.upsert_model(QWEN, 1, replace=True)
    await store.upsert_model(LLAMA, 1, replace=True)
    with pytest.raises(error) as info:
        await store.upsert_model(taking, 2, replace=True)
    assert info.value.code == code
    assert QWEN.id in info.value.message
    assert await models(store) == {QWEN.id: QWEN, LLAMA.id: LLAMA}


async def test_an_alias_refused_on_a_change_leaves_the_model_as_it_was(store: SqlStore) -> None:
    await store.upsert_model(QWEN, 1, replace=True)
    await store.upsert_model(LLAMA, 1, replace=True)
    # A new price and a taken alias: neither is written.
    changed = dataclasses.replace(
        LLAMA, prices=Prices(9, 9, 9), aliases=frozenset({"llama", "qwen-7b"})
    )
    with pytest.raises(InvalidInput):
        await store.upsert_model(changed, 2, replace=True)
    assert await models(store) == {QWEN.id: QWEN, LLAMA.id: LLAMA}


async def test_seeding_an_existing_entry_changes_none_of_its_names(store: SqlStore) -> None:
    await store.upsert_model(QWEN, 1, replace=True)
    seeded = dataclasses.replace(QWEN, aliases=frozenset({"other"}))
    assert await store.upsert_model(seeded, 2, replace=False) == QWEN
    assert await models(store) == {QWEN.id: QWEN}
    # The name the file wanted stays free.
    other = dataclasses.replace(LLAMA, aliases=frozenset({"other"}))
    await store.upsert_model(other, 3, replace=True)
    assert (await models(store))[LLAMA.id] == other


async def test_concurrent_claims_of_one_alias_give_it_to_one_model(store: SqlStore) -> None:
    """Many models ask for the same alias at once: exactly one gets it, the others are
    refused whole (their rows are not written either)."""
    wanting = [
        CatalogModel(f"m{n}", f"m{n}-v1", 4096, 256, aliases=frozenset({"popular", f"own-{n}"}))
        for n in range(12)
    ]
    results = await asyncio.gather(
        *(store.upsert_model(m, 1, replace=True) for m in wanting), return_exceptions=True
    )
    assert results.count(None) == 1, results
    refused = [r for r in results if r is not None]
    assert all(isinstance(r, InvalidInput) and r.code == "alias_taken" for r in refused)
    [winner] = (await models(store)).values()
    assert winner in wanting


async def test_concurrent_writers_of_crossing_names_never_both_win(store: SqlStore) -> None:
    """Two models each taking the other's id as an alias at once: at most one is written,
    and the catalog never has one name for two models."""
    for n in range(5):
        a = CatalogModel(f"a{n}", "a-v1", 4096, 256, aliases=frozenset({f"b{n}"}))
        b = CatalogModel(f"b{n}", "b-v1", 4096, 256, aliases=frozenset({f"a{n}"}))
        results = await asyncio.gather(
            store.upsert_model(a, 1, replace=True),
            store.upsert_model(b, 1, replace=True),
            return_exceptions=True,
        )
        assert results.count(None) == 1, results
        stored = await store.list_models()
        assert len(stored) == n + 1
        names = [name for m in stored for name in m.names]
        assert len(names) == len(set(names)) == 2 * (n + 1)
