"""``backfill admin model list|set|aliases`` and ``backfill admin deployment set``: the catalog
and private deployments, as ``/admin/v1/models`` and ``/admin/v1/deployments`` change them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from backfill.cli.common import ConfigOpt, DataOpt, JsonOpt, admin_settings, run_admin, to_json
from backfill.domain.catalog import CatalogModel
from backfill.domain.endpoints import DEFAULT_MODEL_ENDPOINTS
from backfill.settings import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_MODALITIES,
    DeploymentSettings,
    ModelSettings,
    PricingSettings,
    catalog_model_from,
)

if TYPE_CHECKING:
    from backfill.container import Backfill

ModalitiesOpt = Annotated[str, typer.Option(help="Comma-separated: text, image, audio.")]
MODALITIES = ",".join(DEFAULT_MODALITIES)
EndpointsOpt = Annotated[
    str,
    typer.Option(
        help="Comma-separated batch endpoints: /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/embeddings."
    ),
]
ENDPOINTS = ",".join(sorted(DEFAULT_MODEL_ENDPOINTS))
AliasOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--alias",
        help="Another name request lines may use for the model (exact, case-sensitive); "
        "repeatable. The model gets exactly the aliases given.",
    ),
]


def model_line(m: CatalogModel) -> str:
    if m.private:
        kind = (
            f"private to {m.owner_org_id}, {m.gpu_count} GPU x {m.microusd_per_gpu_second} uUSD/s"
        )
    elif m.prices:
        p = m.prices
        kind = f"batch in/cached/out {p.input}/{p.cached_input}/{p.output} uUSD per 1M tokens"
    else:
        kind = "not batch-qualified"
    serves = ", ".join(sorted(m.endpoints))
    media = ",".join(sorted(m.modalities))
    aliases = f"  aliases {', '.join(sorted(m.aliases))}" if m.aliases else ""
    return (
        f"{m.id}  [{m.model_config_id}]  ctx {m.context_length}  {kind}  ({media}; {serves})"
        f"{aliases}"
    )


def model_list(config: ConfigOpt = None, data: DataOpt = None, json_: JsonOpt = False) -> None:
    """List catalog models and deployments."""

    async def action(b: Backfill) -> str:
        models = await b.services.catalog.all()
        if json_:
            from backfill.adapters.http.presenters import list_object, model_object

            return to_json(list_object([model_object(m) for m in models], False))
        return "\n".join(model_line(m) for m in models)

    run_admin(admin_settings(config, data), action)


def model_set(
    model_id: Annotated[str, typer.Argument(help="Model name requests use.")],
    config_id: Annotated[str, typer.Option("--config-id", help="model_config_id (revision).")],
    context_length: Annotated[int, typer.Option()] = DEFAULT_CONTEXT_LENGTH,
    max_output_tokens: Annotated[int, typer.Option()] = DEFAULT_MAX_OUTPUT_TOKENS,
    input_price: Annotated[int | None, typer.Option(help="uUSD per 1M input tokens.")] = None,
    cached_price: Annotated[int | None, typer.Option(help="uUSD per 1M cached tokens.")] = None,
    output_price: Annotated[int | None, typer.Option(help="uUSD per 1M output tokens.")] = None,
    throughput: Annotated[int | None, typer.Option(help="Output tokens/s for admission.")] = None,
    modalities: ModalitiesOpt = MODALITIES,
    endpoints: EndpointsOpt = ENDPOINTS,
    alias: AliasOpt = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Create or change a model, the whole entry (as PUT /admin/v1/models/ID): without prices
    it is not batch-qualified, without --alias it has no aliases."""
    pricing = None
    if input_price is not None and output_price is not None:
        pricing = PricingSettings(input=input_price, cached_input=cached_price, output=output_price)
    spec = ModelSettings(
        id=model_id,
        model_config_id=config_id,
        context_length=context_length,
        max_output_tokens=max_output_tokens,
        modalities=modalities.split(","),
        endpoints=endpoints.split(","),
        batch=pricing,
        throughput_tokens_per_s=throughput,
        aliases=alias or [],
    )

    async def action(b: Backfill) -> str:
        return model_line(await b.services.catalog.put(catalog_model_from(spec)))

    run_admin(admin_settings(config, data), action, audited=("model.put", model_id))


def model_aliases(
    model_id: Annotated[str, typer.Argument(help="The catalog model's id.")],
    aliases: Annotated[
        list[str] | None,
        typer.Argument(help="Its aliases, all of them (none: it keeps no alias)."),
    ] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Set a model's aliases, keeping the rest of its entry (as PATCH /admin/v1/models/ID with
    {"aliases": [...]})."""

    async def action(b: Backfill) -> str:
        return model_line(await b.services.catalog.change(model_id, {"aliases": aliases or []}))

    run_admin(admin_settings(config, data), action, audited=("model.update", model_id))


def deployment_set(
    deployment_id: Annotated[str, typer.Argument(help="Name requests use as body.model.")],
    org: Annotated[str, typer.Option(help="Owning organization.")],
    config_id: Annotated[str, typer.Option("--config-id", help="model_config_id served.")],
    gpus: Annotated[int, typer.Option(help="GPUs of the deployment.")] = 1,
    gpu_second_price: Annotated[int, typer.Option(help="uUSD per GPU-second.")] = 0,
    context_length: Annotated[int, typer.Option()] = DEFAULT_CONTEXT_LENGTH,
    max_output_tokens: Annotated[int, typer.Option()] = DEFAULT_MAX_OUTPUT_TOKENS,
    modalities: ModalitiesOpt = MODALITIES,
    endpoints: EndpointsOpt = ENDPOINTS,
    config: ConfigOpt = None,
    data: DataOpt = None,
) -> None:
    """Create or change a private deployment."""
    spec = DeploymentSettings(
        id=deployment_id,
        org=org,
        model_config_id=config_id,
        gpu_count=gpus,
        microusd_per_gpu_second=gpu_second_price,
        context_length=context_length,
        max_output_tokens=max_output_tokens,
        modalities=modalities.split(","),
        endpoints=endpoints.split(","),
    )

    async def action(b: Backfill) -> str:
        owner = await b.services.tenants.org(org)
        return model_line(await b.services.catalog.put(catalog_model_from(spec, owner.id)))

    run_admin(admin_settings(config, data), action, audited=("deployment.put", deployment_id))
