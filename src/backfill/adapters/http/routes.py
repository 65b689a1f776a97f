"""Routes of /v1: files, batches, models."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from starlette.responses import Response

from backfill.adapters.http import download
from backfill.adapters.http.audit import audited
from backfill.adapters.http.deps import principal, services
from backfill.adapters.http.multipart import stream_form
from backfill.adapters.http.presenters import (
    batch_object,
    file_object,
    list_object,
    model_object,
    notification_object,
    receipt_object,
)
from backfill.adapters.http.requests import create_batch_request
from backfill.adapters.http.responses import json_response
from backfill.errors import InvalidInput, NotFound
from backfill.services.bundle import Services
from backfill.services.files import parse_expires_after
from backfill.services.tenants import READ, WRITE, Principal

router = APIRouter(prefix="/v1")
Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]


@router.post("/files", summary="Upload a batch input file (validated whole before the reply)")
async def upload_file(request: Request, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    upload = await svc.files.begin_upload(caller.org_id)
    try:
        fields, saw_file = await stream_form(
            request.headers.get("content-type", ""), request.stream(), upload.feed
        )
        if not saw_file:
            raise InvalidInput(
                "The form has no 'file' part; send the JSONL file as the field 'file'.",
                code="missing_required_parameter",
                param="file",
            )
        expires = parse_expires_after(
            fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
        )
        record = await upload.finish(fields.get("purpose"), expires)
    except BaseException:
        await upload.abort()
        raise
    return json_response(file_object(record))


@router.get("/files", summary="List files, newest first")
async def list_files(
    caller: Caller,
    svc: Svc,
    purpose: str | None = None,
    limit: Annotated[int, Query()] = 10000,
    order: str = "desc",
    after: str | None = None,
) -> Response:
    caller.require(READ)
    page = await svc.files.list_files(caller.org_id, purpose, after, limit, order)
    return json_response(list_object([file_object(f) for f in page.items], page.has_more))


@router.get("/files/{file_id}", summary="Retrieve a file object")
async def get_file(file_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    return json_response(file_object(await svc.files.get(caller.org_id, file_id)))


@router.delete(
    "/files/{file_id}",
    summary="Delete a file and its content",
    dependencies=[audited("file.delete", "file_id")],
)
async def delete_file(file_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    record = await svc.files.delete(caller.org_id, file_id)
    return json_response({"id": record.id, "object": "file", "deleted": True})


# Two routes, one handler: each method gets its own OpenAPI operation id.
@router.get("/files/{file_id}/content", summary="Download a file's bytes (ETag, Range)")
@router.head("/files/{file_id}/content", summary="A file's content headers, without the bytes")
async def file_content(
    request: Request,
    file_id: str,
    caller: Caller,
    svc: Svc,
    range_: Annotated[str | None, Header(alias="range")] = None,
    if_range: Annotated[str | None, Header(alias="if-range")] = None,
    if_none_match: Annotated[str | None, Header(alias="if-none-match")] = None,
) -> Response:
    caller.require(READ)
    record = await svc.files.get(caller.org_id, file_id)
    return await download.file_content(
        svc.files,
        record,
        head=request.method == "HEAD",
        range_=range_,
        if_range=if_range,
        if_none_match=if_none_match,
    )


@router.post(
    "/batches",
    summary="Create a batch from an uploaded file",
    dependencies=[audited("batch.create")],
)
async def create_batch(
    request: Request,
    caller: Caller,
    svc: Svc,
    idempotency_key: Annotated[str | None, Header(alias="idempotency-key")] = None,
) -> Response:
    caller.require(WRITE)
    body, request_hash = create_batch_request(await request.body())
    batch, _ = await svc.batches.create(
        caller.org_id, body, idempotency_key, request_hash, api_key_id=caller.key_id
    )
    return json_response(batch_object(batch))


@router.get("/batches", summary="List batches, newest first")
async def list_batches(
    caller: Caller, svc: Svc, limit: int = 20, after: str | None = None
) -> Response:
    caller.require(READ)
    page = await svc.batches.list(caller.org_id, after, limit)
    return json_response(list_object([batch_object(b) for b in page.items], page.has_more))


@router.get("/batches/{batch_id}", summary="Retrieve a batch")
async def get_batch(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    return json_response(batch_object(await svc.batches.get(caller.org_id, batch_id)))


@router.post(
    "/batches/{batch_id}/cancel",
    summary="Cancel a batch",
    dependencies=[audited("batch.cancel", "batch_id")],
)
async def cancel_batch(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(WRITE)
    return json_response(batch_object(await svc.batches.cancel(caller.org_id, batch_id)))


@router.get(
    "/batches/{batch_id}/notifications",
    summary="The batch's webhook, endpoint and email notifications and their delivery",
)
async def batch_notifications(batch_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    sent = await svc.notifications.deliveries(caller.org_id, batch_id)
    return json_response(list_object([notification_object(n) for n in sent], False))


@router.get("/models", summary="The model catalog (with this org's private deployments)")
async def list_models(caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    models = await svc.catalog.all(caller.org_id)
    return json_response(list_object([model_object(m) for m in models], False))


@router.get("/models/{model:path}", summary="One model, by its id or one of its aliases")
async def get_model(model: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    found = await svc.catalog.resolve(model, caller.org_id)
    if found is None:
        raise NotFound(
            f"The model {model!r} does not exist; GET /v1/models lists the models and their "
            "aliases.",
            code="model_not_found",
            param="model",
        )
    return json_response(model_object(found))


@router.get("/receipts/{request_id}", summary="What one request was charged")
async def get_receipt(request_id: str, caller: Caller, svc: Svc) -> Response:
    caller.require(READ)
    return json_response(receipt_object(await svc.billing.receipt(caller.org_id, request_id)))
