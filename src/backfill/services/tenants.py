"""Organizations and API keys (SPEC §7.1)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from backfill.domain import ids
from backfill.errors import Forbidden, InvalidInput, NotFound, Unauthorized
from backfill.ports import ApiKey, Clock, Org, Store

WRITE = "inference:write"
READ = "requests:read"
SCOPES = frozenset({WRITE, READ})
KEY_PREFIX = "bf-"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    org_id: str
    scopes: frozenset[str]

    def require(self, scope: str) -> None:
        # inference:write includes reading (SPEC §7.1).
        if scope in self.scopes or (scope == READ and WRITE in self.scopes):
            return
        raise Forbidden(
            f"This API key lacks the '{scope}' scope; create a key with it "
            f"(backfill admin key create --scopes {scope})."
        )


class TenantService:
    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def create_org(self, name: str) -> Org:
        org = Org(id=ids.org_id(), name=name, created_at=int(self._clock.now()))
        await self._store.create_org(org)
        return org

    async def create_key(self, org_name: str, scopes: frozenset[str]) -> str:
        """Make a key for ``org_name``; returns the secret, which is never stored."""
        unknown = scopes - SCOPES
        if unknown or not scopes:
            raise InvalidInput(
                f"Unknown scopes {sorted(unknown)}; use {WRITE} and/or {READ}.", param="scopes"
            )
        org = await self._store.org_by_name(org_name)
        if org is None:
            raise NotFound(f"No organization named {org_name!r}; create it first.")
        body = secrets.token_urlsafe(32)  # 256 bits
        prefix = KEY_PREFIX + body[:6]
        secret = f"{KEY_PREFIX}{body}"
        key = ApiKey(id=f"key_{secrets.token_hex(8)}", org_id=org.id, prefix=prefix, scopes=scopes)
        await self._store.create_api_key(key, hash_secret(secret))
        return secret

    async def authenticate(self, secret: str | None) -> Principal:
        if not secret:
            raise Unauthorized(
                "No API key given; send it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        key = await self._store.api_key_by_hash(hash_secret(secret))
        if key is None:
            raise Unauthorized("The API key is not valid; check it or create a new one.")
        return Principal(org_id=key.org_id, scopes=key.scopes)

    async def bootstrap(self, name: str = "default", credit: int = 0) -> str | None:
        """On an empty database make org ``name`` with ``credit`` picodollars and return a key
        with both scopes."""
        if await self._store.count_orgs():
            return None
        org = await self.create_org(name)
        if credit > 0:
            await self._store.add_credit(org.id, credit, "starting credit", int(self._clock.now()))
        return await self.create_key(name, SCOPES)

    async def org(self, name: str) -> Org:
        org = await self._store.org_by_name(name)
        if org is None:
            raise NotFound(f"No organization named {name!r}; create it first.")
        return org
