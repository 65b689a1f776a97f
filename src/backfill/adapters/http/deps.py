"""What route handlers get injected: the services and the caller's identity."""

from __future__ import annotations

from fastapi import Request

from backfill.adapters.http.auth import bearer
from backfill.services.bundle import Services
from backfill.services.tenants import Principal


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


async def principal(request: Request) -> Principal:
    secret = bearer(request.scope["headers"])
    # Latin-1 maps every byte, as Starlette decodes headers: an odd key is a wrong key, not 500.
    return await services(request).tenants.authenticate(
        secret.decode("latin-1") if secret is not None else None
    )
