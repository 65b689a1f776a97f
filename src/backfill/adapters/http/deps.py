"""What route handlers get injected: the services and the caller's identity."""

from __future__ import annotations

from fastapi import Request

from backfill.adapters.http.auth import bearer
from backfill.domain import audit
from backfill.services.bundle import Services
from backfill.services.tenants import Principal


def _services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


# Dependencies are coroutines: FastAPI runs a plain function in a thread pool, a hand-off to
# another thread and back on every request (a third of a status poll's CPU).
async def services(request: Request) -> Services:
    return _services(request)


async def principal(request: Request) -> Principal:
    secret = bearer(request.scope["headers"])
    # Latin-1 maps every byte, as Starlette decodes headers: an odd key is a wrong key, not 500.
    caller = await _services(request).tenants.authenticate(
        secret.decode("latin-1") if secret is not None else None
    )
    audit.note_actor(caller.key_id, caller.org_id)
    return caller
