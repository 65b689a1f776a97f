"""Model aliases (docs/api.md, "Model aliases"): which names mean which model, the clashes
that are refused, and how a file's lines resolve an alias to its model at upload."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from backfill.domain.catalog import CatalogModel, by_name, name_clash, name_taken
from backfill.domain.input_format import Limits, LineError, LineValidator
from backfill.domain.money import Prices
from backfill.errors import Conflict, InvalidInput
from backfill.settings import (
    DeploymentSettings,
    ModelSettings,
    PricingSettings,
    Settings,
    catalog_model_from,
    changed_model,
)

PRICES = Prices(100, 50, 400)
QWEN = CatalogModel(
    "Qwen/Qwen2.5-7B-Instruct",
    "qwen-v1",
    4096,
    1024,
    prices=PRICES,
    aliases=frozenset({"qwen-7b", "gpt-4o-mini"}),
)
LLAMA = CatalogModel("meta/llama", "llama-v1", 4096, 1024, prices=PRICES)
UNPRICED = CatalogModel("unpriced", "unpriced-v1", 4096, 1024, aliases=frozenset({"cheap"}))
LIMITS = Limits(max_file_bytes=1 << 30, max_lines=1000, max_line_bytes=1 << 20)


def validator() -> LineValidator:
    return LineValidator(LIMITS, by_name([QWEN, LLAMA, UNPRICED]).get)


def line(custom_id: str, model: str, **body: Any) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16,
                **body,
            },
        }
    )


# ---- names ---------------------------------------------------------------------------------


def test_every_name_of_a_model_finds_it() -> None:
    names = by_name([QWEN, LLAMA])
    assert names == {
        "Qwen/Qwen2.5-7B-Instruct": QWEN,
        "qwen-7b": QWEN,
        "gpt-4o-mini": QWEN,
        "meta/llama": LLAMA,
    }
    assert QWEN.names == {"Qwen/Qwen2.5-7B-Instruct", "qwen-7b", "gpt-4o-mini"}


def test_names_are_exact_and_case_sensitive() -> None:
    names = by_name([QWEN])
    for near in ("Qwen-7B", "QWEN-7B", "qwen-7b ", " qwen-7b", "qwen/qwen2.5-7b-instruct"):
        assert near not in names


def test_an_alias_that_is_another_models_id_or_alias_clashes() -> None:
    takes_id = CatalogModel("new", "new-v1", 4096, 1024, aliases=frozenset({"meta/llama"}))
    assert name_clash(takes_id, [QWEN, LLAMA]) == ("meta/llama", LLAMA)
    takes_alias = CatalogModel("new", "new-v1", 4096, 1024, aliases=frozenset({"x", "qwen-7b"}))
    assert name_clash(takes_alias, [QWEN, LLAMA]) == ("qwen-7b", QWEN)
    # A new id that is another model's alias.
    named_like_alias = CatalogModel("gpt-4o-mini", "v1", 4096, 1024)
    assert name_clash(named_like_alias, [QWEN, LLAMA]) == ("gpt-4o-mini", QWEN)


def test_a_model_does_not_clash_with_itself_before_a_change() -> None:
    fewer = CatalogModel(QWEN.id, "qwen-v2", 4096, 1024, aliases=frozenset({"qwen-7b"}))
    assert name_clash(fewer, [QWEN, LLAMA]) is None
    assert name_clash(LLAMA, [QWEN, LLAMA]) is None


def test_a_taken_alias_is_a_400_naming_it_and_its_holder() -> None:
    error = name_taken("qwen-7b", "meta/llama", QWEN.id)
    assert isinstance(error, InvalidInput)
    assert (error.status, error.code, error.param) == (400, "alias_taken", "aliases")
    assert "'qwen-7b' is an alias of model 'Qwen/Qwen2.5-7B-Instruct'" in error.message
    assert "'meta/llama'" in error.message
    by_id = name_taken("meta/llama", "new", "meta/llama")
    assert (by_id.status, by_id.code) == (400, "alias_taken")
    assert "is the id of model 'meta/llama'" in by_id.message


def test_an_id_that_is_another_models_alias_is_a_409() -> None:
    error = name_taken("gpt-4o-mini", "gpt-4o-mini", QWEN.id)
    assert isinstance(error, Conflict)
    assert (error.status, error.code) == (409, "model_id_taken")
    assert "'gpt-4o-mini' is an alias of model 'Qwen/Qwen2.5-7B-Instruct'" in error.message
    assert "another id" in error.message


# ---- lines ---------------------------------------------------------------------------------


def test_a_file_of_alias_lines_is_the_aliased_model() -> None:
    v = validator()
    assert v.check_lines([line("a", "qwen-7b"), line("b", "qwen-7b")], 1) == ["a", "b"]
    assert v.summary().model == QWEN.id


def test_an_alias_and_its_models_id_in_one_file_are_one_model() -> None:
    v = validator()
    lines = [
        line("a", "gpt-4o-mini"),
        line("b", QWEN.id),
        line("c", "qwen-7b"),
        line("d", "gpt-4o-mini"),
    ]
    assert v.check_lines(lines, 1) == ["a", "b", "c", "d"]
    assert v.summary().model == QWEN.id
    assert v.summary().lines == 4


def test_the_limits_of_the_aliased_model_apply() -> None:
    with pytest.raises(LineError) as info:
        validator().check_lines([line("a", "qwen-7b", max_tokens=QWEN.max_output_tokens + 1)], 1)
    assert info.value.param == "body.max_tokens"
    assert info.value.line == 1


def test_a_duplicate_custom_id_across_names_is_still_refused() -> None:
    with pytest.raises(LineError) as info:
        validator().check_lines([line("a", "qwen-7b"), line("a", QWEN.id)], 1)
    assert (info.value.code, info.value.line) == ("duplicate_custom_id", 2)


def test_an_alias_of_another_model_is_mixed_models_naming_both() -> None:
    v = validator()
    with pytest.raises(LineError) as info:
        v.check_lines([line("a", "qwen-7b"), line("b", LLAMA.id)], 1)
    error = info.value
    assert (error.code, error.line, error.param) == ("mixed_models", 2, "body.model")
    assert "'meta/llama'" in error.message
    assert f"'qwen-7b' (model {QWEN.id!r})" in error.message


@pytest.mark.parametrize("name", ["no-such-model", "QWEN-7B", "Qwen-7b"])
def test_an_unknown_name_is_model_not_found_with_its_line(name: str) -> None:
    with pytest.raises(LineError) as info:
        validator().check_lines([line("a", name)], 7)
    error = info.value
    assert (error.code, error.line, error.param) == ("model_not_found", 7, "body.model")
    assert error.message.startswith("Line 7:")
    assert repr(name) in error.message


def test_an_unknown_name_after_an_alias_names_its_line() -> None:
    with pytest.raises(LineError) as info:
        validator().check_lines([line("a", "qwen-7b"), line("b", "qwen-8b")], 1)
    assert (info.value.code, info.value.line) == ("mixed_models", 2)


def test_an_alias_of_a_model_without_batch_prices_is_not_for_batch() -> None:
    with pytest.raises(LineError) as info:
        validator().check_lines([line("a", "cheap")], 1)
    assert info.value.code == "model_not_found"
    assert "not available for batch" in info.value.message


# ---- settings ------------------------------------------------------------------------------


def model(model_id: str, *aliases: str) -> ModelSettings:
    return ModelSettings(
        id=model_id,
        model_config_id=f"{model_id}-v1",
        batch=PricingSettings(input=1, output=2),
        aliases=list(aliases),
    )


def test_a_file_model_carries_its_aliases() -> None:
    entry = catalog_model_from(model("m", "a", "b", "a"))
    assert entry.aliases == {"a", "b"}


@pytest.mark.parametrize(
    ("models", "clash"),
    [
        ([model("m", "shared"), model("n", "shared")], "'shared'"),
        ([model("m"), model("n", "m")], "'m'"),
        ([model("m", "n"), model("n")], "'n'"),
    ],
)
def test_a_file_giving_one_name_to_two_models_is_refused(
    models: list[ModelSettings], clash: str
) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(local_engine=False, models=models)
    assert clash in str(info.value)
    assert "one name means one model" in str(info.value)


def test_a_file_alias_may_not_be_a_deployments_id() -> None:
    deployment = DeploymentSettings(
        id="dep", org="acme", model_config_id="d-v1", microusd_per_gpu_second=1
    )
    with pytest.raises(ValidationError, match="'dep'"):
        Settings(local_engine=False, models=[model("m", "dep")], deployments=[deployment])


def test_a_change_keeps_every_field_it_does_not_name() -> None:
    entry = catalog_model_from(model("m", "a"))
    entry = changed_model(entry, {"throughput_tokens_per_s": 50})
    renamed = changed_model(entry, {"aliases": ["b", "c"]})
    assert renamed.aliases == {"b", "c"}
    assert renamed.prices == entry.prices
    assert renamed.throughput_tokens_per_s == 50
    assert changed_model(renamed, {}) == renamed
    assert changed_model(renamed, {"aliases": []}).aliases == frozenset()
    unpriced = changed_model(renamed, {"batch": None})
    assert unpriced.prices is None
    assert unpriced.aliases == {"b", "c"}
