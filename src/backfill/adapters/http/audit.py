"""The API's side of the audit log (domain/audit.py): every state-changing request is an
``AuditScope`` while it is served; a route that is an audited action names itself with
``audited``, the credential checks say who acts, and once the answer is known the scope is
settled (its outcome, or its row where the action never reached a write)."""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import Depends, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.domain import audit
from backfill.domain.audit import AuditScope

# Methods that may change state: the only requests that can be audited actions.
_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# An error answer's body is read for its code only; an envelope is far below this.
_ERROR_BODY_LIMIT = 16_384


def audited(action: str, target: str | None = None) -> Any:
    """A route's dependency naming its audited ``action``; ``target`` is the path parameter
    holding what it acts on (a create names its new id itself, through ``note_target``)."""

    async def name(request: Request) -> None:
        audit.note_action(action, request.path_params.get(target) if target else None)

    return Depends(name)


class AuditTrail:
    """Pure ASGI, outside the routes: it sees the status and the error code of every answer,
    those of refusals made before a route ran included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _CHANGING:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        action = AuditScope(at=time.time(), address=str(client[0]) if client else None)
        status = 500
        error_body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (
                message["type"] == "http.response.body"
                and status >= 400
                and len(error_body) < _ERROR_BODY_LIMIT
            ):
                error_body.extend(message.get("body", b"")[:_ERROR_BODY_LIMIT])
            await send(message)

        try:
            with audit.acting(action):
                await self.app(scope, receive, watch)
        finally:
            if action.action:
                services = scope["app"].state.services
                await services.audit.settle(action, status, _error_code(error_body))


def _error_code(body: bytes | bytearray) -> str | None:
    """The envelope's ``code`` (else its ``type``): never its message, which may quote input."""
    if not body:
        return None
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    found = error.get("code") or error.get("type")
    return found if isinstance(found, str) else None
