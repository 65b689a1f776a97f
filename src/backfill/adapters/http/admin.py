"""The admin API under /admin/v1, mirroring ``backfill admin`` (SPEC §11.3)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from backfill.adapters.http.audit import audited
from backfill.adapters.http.auth import admin_refusal
from backfill.adapters.http.deps import services
from backfill.adapters.http.presenters import api_key_object, list_object, model_object
from backfill.adapters.http.responses import json_response
from backfill.domain import audit
from backfill.domain.audit import ADMIN, AuditEntry
from backfill.domain.engine_config import StoredEngine
from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.money import pico_to_usd
from backfill.domain.notifications import Endpoint
from backfill.domain.records import ApiKey, Ledger, Org
from backfill.errors import InvalidInput
from backfill.services.audit import entry_id
from backfill.services.bundle import Services
from backfill.services.engine_admin import EngineAdmin
from backfill.services.notifications import SigningSecret
from backfill.settings import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_MAX_OUTPUT_TOKENS,
    DeploymentSettings,
    ModelSettings,
    catalog_model_from,
    default_endpoints,
    default_modalities,
)

router = APIRouter(prefix="/admin/v1", include_in_schema=False)


async def require_admin(request: Request) -> None:
    # EdgeGuard already refused these requests before their body was read; checking again
    # keeps the routes closed wherever the router is mounted.
    refusal = admin_refusal(request.scope["headers"], request.app.state.admin_token)
    if refusal is not None:
        raise refusal
    audit.note_actor(ADMIN)


Admin = Annotated[None, Depends(require_admin)]
Svc = Annotated[Services, Depends(services)]


# Names and amounts are checked by the services (printable, lengths, money caps) so the CLI
# gets the same answers; the bounds here only keep absurd inputs from reaching them.
class OrgIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=1000)


class OrgPatch(BaseModel):
    # Unknown fields are refused, never ignored; the values' types and ranges are checked by
    # the services, so the CLI and the API give the same answer.
    model_config = ConfigDict(extra="forbid")
    weight: Any = None
    max_priority: Any = None


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    org: str = Field(max_length=1000)
    scopes: list[str] = Field(default=["inference:write", "requests:read"], max_length=10)
    name: str | None = Field(default=None, max_length=1000)


class CreditIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    org: str = Field(max_length=1000)
    usd: str = Field(max_length=64)
    note: str | None = Field(default=None, max_length=1000)


class PricingIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: int = Field(ge=0)
    cached_input: int | None = Field(default=None, ge=0)
    output: int = Field(ge=0)


# The fields of ModelSettings and DeploymentSettings but the id, which is in the path. A field
# they do not have is refused, never ignored (the 2026-12-05 review, finding L5).
class ModelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_config_id: str
    context_length: int = Field(default=DEFAULT_CONTEXT_LENGTH, ge=1)
    max_output_tokens: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1)
    modalities: list[str] = Field(default_factory=default_modalities)
    endpoints: list[str] = Field(default_factory=default_endpoints)
    batch: PricingIn | None = None
    throughput_tokens_per_s: int | None = Field(default=None, ge=1)
    aliases: list[str] = Field(default_factory=list, max_length=100)


class ModelPatch(ModelIn):
    # The fields a PATCH sends are changed, the others kept: ``model_config_id`` is optional
    # here only (its default is never used, unset fields are left out).
    model_config_id: str = ""


class DeploymentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    org: str
    model_config_id: str
    gpu_count: int = Field(default=1, ge=1)
    microusd_per_gpu_second: int = Field(ge=0)
    context_length: int = Field(default=DEFAULT_CONTEXT_LENGTH, ge=1)
    max_output_tokens: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1)
    modalities: list[str] = Field(default_factory=default_modalities)
    endpoints: list[str] = Field(default_factory=default_endpoints)


def ledger_object(org: str, ledger: Ledger) -> dict[str, Any]:
    return {
        "org": org,
        "unit": "usd",
        "credits": pico_to_usd(ledger.credits),
        "charges": pico_to_usd(ledger.charges),
        "balance": pico_to_usd(ledger.balance),
        "reserved": pico_to_usd(ledger.reserved),
        "available": pico_to_usd(ledger.available),
    }


def org_object(org: Org) -> dict[str, Any]:
    return {
        "id": org.id,
        "object": "organization",
        "name": org.name,
        "created_at": org.created_at,
        "weight": org.weight,
        "max_priority": org.max_priority,
    }


def key_object(key: ApiKey) -> dict[str, Any]:
    return {
        **api_key_object(key),
        "last_used_at": key.last_used_at,
        "revoked_at": key.revoked_at,
    }


@router.post("/orgs", dependencies=[audited("org.create")])
async def create_org(body: OrgIn, _: Admin, svc: Svc) -> Response:
    audit.note_target(body.name)
    return json_response(org_object(await svc.tenants.create_org(body.name)))


@router.get("/orgs/{name}")
async def get_org(name: str, _: Admin, svc: Svc) -> Response:
    return json_response(org_object(await svc.tenants.org(name)))


@router.patch("/orgs/{name}", dependencies=[audited("org.update", "name")])
async def patch_org(name: str, body: OrgPatch, _: Admin, svc: Svc) -> Response:
    # A field sent as null is refused by its check, not taken as absent.
    sent = body.model_fields_set
    if not sent:
        raise InvalidInput(
            "Send 'weight' (fair share), 'max_priority' (the cap on its batches' priority) or "
            "both.",
            code="missing_required_parameter",
            param="weight",
        )
    changes = {field: getattr(body, field) for field in sent}
    return json_response(org_object(await svc.controls.update_org(name, changes)))


@router.post("/keys", dependencies=[audited("key.create")])
async def create_key(body: KeyIn, _: Admin, svc: Svc) -> Response:
    made = await svc.tenants.new_key(body.org, frozenset(body.scopes), body.name)
    return json_response({"key": made.secret, **key_object(made.key)})


@router.get("/orgs/{name}/keys")
async def list_keys(name: str, _: Admin, svc: Svc) -> Response:
    keys = await svc.tenants.keys(name)
    return json_response(list_object([key_object(k) for k in keys], False))


@router.delete("/keys/{key_id}", dependencies=[audited("key.revoke", "key_id")])
async def revoke_key(key_id: str, _: Admin, svc: Svc) -> Response:
    return json_response(key_object(await svc.tenants.revoke_key(key_id)))


@router.post("/credits", dependencies=[audited("credit.add")])
async def add_credit(body: CreditIn, _: Admin, svc: Svc) -> Response:
    # The answer is what the crediting transaction committed: no second read that could fail
    # after the money is in and tempt a retry that credits twice.
    audit.note_target(body.org)
    return json_response(
        ledger_object(body.org, await svc.billing.credit(body.org, body.usd, body.note))
    )


@router.get("/orgs/{name}/ledger")
async def ledger(name: str, _: Admin, svc: Svc) -> Response:
    org = await svc.tenants.org(name)
    return json_response(ledger_object(name, await svc.billing.ledger(org.id)))


@router.get("/models")
async def list_models(_: Admin, svc: Svc) -> Response:
    models = await svc.catalog.all()
    return json_response(list_object([model_object(m) for m in models], False))


@router.put("/models/{model_id:path}", dependencies=[audited("model.put", "model_id")])
async def put_model(model_id: str, body: ModelIn, _: Admin, svc: Svc) -> Response:
    spec = ModelSettings(id=model_id, **body.model_dump())
    return json_response(model_object(await svc.catalog.put(catalog_model_from(spec))))


@router.patch("/models/{model_id:path}", dependencies=[audited("model.update", "model_id")])
async def patch_model(model_id: str, body: ModelPatch, _: Admin, svc: Svc) -> Response:
    """Change some fields of a catalog model (``aliases`` replaces its aliases), keeping the
    others; a PUT replaces the whole entry."""
    changes = body.model_dump(exclude_unset=True)
    return json_response(model_object(await svc.catalog.change(model_id, changes)))


@router.put(
    "/deployments/{deployment_id:path}", dependencies=[audited("deployment.put", "deployment_id")]
)
async def put_deployment(deployment_id: str, body: DeploymentIn, _: Admin, svc: Svc) -> Response:
    org = await svc.tenants.org(body.org)
    spec = DeploymentSettings(id=deployment_id, **body.model_dump())
    return json_response(model_object(await svc.catalog.put(catalog_model_from(spec, org.id))))


def engine_object(report: EngineReport) -> dict[str, Any]:
    """One engine as one live worker sees it (docs/api.md, "Admin: engines")."""
    healthy = report.state == EngineState.UP

    def stamp(ts: float | None) -> int | None:
        return None if ts is None else int(ts)

    return {
        "id": report.engine,
        "object": "engine",
        "worker": report.worker,
        "url": report.url,
        "models": list(report.models),
        "healthy": healthy,
        "state": report.state.value,
        "last_error": report.last_error,
        "checked_at": stamp(report.checked_at),
        "healthy_since": stamp(report.since) if healthy else None,
        "down_since": stamp(report.since) if report.state == EngineState.DOWN else None,
        "in_flight": report.in_flight,
        "max_concurrency": report.max_concurrency,
        "mode": report.mode,
        "concurrency_limit": report.concurrency_limit,
        "signal": report.signal,
        "pressure": report.pressure,
        "priority": report.priority,
        # Learnt how long its starts on demand take (seconds; null: not started on demand).
        "start_s": None if report.start_s is None else round(report.start_s, 1),
    }


@router.get("/engines")
async def list_engines(_: Admin, svc: Svc) -> Response:
    engines = await svc.operations.engines()
    return json_response(list_object([engine_object(e) for e in engines], False))


def stored_engine_object(admin: EngineAdmin, engine: StoredEngine) -> dict[str, Any]:
    """An engine as stored for every worker (docs/fleet.md): its settings, defaults included,
    and whether it has an API key, never the key."""
    settings = admin.shown(engine).model_dump(mode="json", exclude={"name", "api_key"})
    return {
        "id": engine.name,
        "object": "engine.settings",
        "enabled": engine.enabled,
        "source": engine.source.value,
        "updated_at": int(engine.updated_at),
        "has_api_key": engine.api_key_sealed is not None,
        **settings,
    }


@router.get("/engine_settings")
async def list_stored_engines(_: Admin, svc: Svc) -> Response:
    engines = [stored_engine_object(svc.engines, e) for e in await svc.engines.all()]
    return json_response(list_object(engines, False))


@router.post("/engines", dependencies=[audited("engine.create")])
async def add_engine(body: Annotated[dict[str, Any], Body()], _: Admin, svc: Svc) -> Response:
    if isinstance(name := body.get("name"), str):
        audit.note_target(name)
    return json_response(stored_engine_object(svc.engines, await svc.engines.add(body)))


@router.get("/engines/{name}")
async def get_engine(name: str, _: Admin, svc: Svc) -> Response:
    return json_response(stored_engine_object(svc.engines, await svc.engines.get(name)))


@router.patch("/engines/{name}", dependencies=[audited("engine.update", "name")])
async def change_engine(
    name: str, body: Annotated[dict[str, Any], Body()], _: Admin, svc: Svc
) -> Response:
    return json_response(stored_engine_object(svc.engines, await svc.engines.change(name, body)))


@router.delete("/engines/{name}", dependencies=[audited("engine.delete", "name")])
async def remove_engine(name: str, _: Admin, svc: Svc) -> Response:
    await svc.engines.remove(name)
    return json_response({"id": name, "object": "engine.deleted", "deleted": True})


# ---- notifications (docs/notifications.md) ------------------------------------------------


class EndpointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Types and values are checked by the service, so the CLI and the API answer the same.
    url: Any
    events: Any


class EmailIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    email: Any


def endpoint_object(endpoint: Endpoint) -> dict[str, Any]:
    return {
        "id": endpoint.id,
        "object": "webhook_endpoint",
        "url": endpoint.url,
        "events": sorted(endpoint.events),
    }


def secret_object(org: str, signing: SigningSecret) -> dict[str, Any]:
    return {
        "org": org,
        "object": "webhook_secret",
        "secret": signing.secret,
        "previous_valid_until": signing.previous_valid_until,
    }


@router.get("/orgs/{name}/webhook_secret")
async def get_webhook_secret(name: str, _: Admin, svc: Svc) -> Response:
    return json_response(secret_object(name, await svc.notifications.signing_secret(name)))


@router.post(
    "/orgs/{name}/webhook_secret/rotate", dependencies=[audited("webhook_secret.rotate", "name")]
)
async def rotate_webhook_secret(name: str, _: Admin, svc: Svc) -> Response:
    return json_response(
        secret_object(name, await svc.notifications.signing_secret(name, rotate=True))
    )


@router.post("/orgs/{name}/webhooks", dependencies=[audited("webhook.create", "name")])
async def add_webhook(name: str, body: EndpointIn, _: Admin, svc: Svc) -> Response:
    endpoint = await svc.notifications.add_endpoint(name, body.url, body.events)
    return json_response(endpoint_object(endpoint))


@router.get("/orgs/{name}/webhooks")
async def list_webhooks(name: str, _: Admin, svc: Svc) -> Response:
    endpoints = await svc.notifications.endpoints(name)
    return json_response(list_object([endpoint_object(e) for e in endpoints], False))


@router.delete(
    "/orgs/{name}/webhooks/{endpoint_id}", dependencies=[audited("webhook.delete", "endpoint_id")]
)
async def remove_webhook(name: str, endpoint_id: str, _: Admin, svc: Svc) -> Response:
    await svc.notifications.remove_endpoint(name, endpoint_id)
    return json_response({"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True})


@router.get("/orgs/{name}/notifications")
async def get_notify_email(name: str, _: Admin, svc: Svc) -> Response:
    return json_response({"org": name, "email": await svc.notifications.email(name)})


@router.put("/orgs/{name}/notifications", dependencies=[audited("notification_email.set", "name")])
async def set_notify_email(name: str, body: EmailIn, _: Admin, svc: Svc) -> Response:
    return json_response(
        {"org": name, "email": await svc.notifications.set_email(name, body.email)}
    )


def audit_object(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry_id(entry),
        "object": "audit_entry",
        "at": entry.at,
        "actor": entry.actor,
        "org_id": entry.org_id,
        "action": entry.action,
        "target": entry.target,
        "address": entry.address,
        "outcome": entry.outcome.value,
        "status": entry.status,
        "error": entry.error,
    }


@router.get("/audit")
async def audit_log(
    _: Admin,
    svc: Svc,
    limit: int = 20,
    after: str | None = None,
    org: str | None = None,
    action: str | None = None,
    actor: str | None = None,
) -> Response:
    page = await svc.audit.page(after=after, limit=limit, org=org, action=action, actor=actor)
    return json_response(list_object([audit_object(e) for e in page.entries], page.has_more))
