"""Organizations and API keys (SPEC §7.1)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from backfill.domain import audit, ids
from backfill.domain.records import ApiKey, Org
from backfill.domain.scheduling.fair_share import WeightRefused, check_weight
from backfill.errors import Forbidden, InvalidInput, NotFound, Unauthorized
from backfill.ports import Clock, LedgerStore, TenantStore

WRITE = "inference:write"
READ = "requests:read"
SCOPES = frozenset({WRITE, READ})
KEY_PREFIX = "bf-"
MAX_ORG_NAME_CHARS = 64
MAX_KEY_NAME_CHARS = 100
# Authentication writes last_used_at at most this often per key, so reads stay reads.
LAST_USED_RESOLUTION_S = 60


def no_such_key(key_id: str) -> NotFound:
    return NotFound(
        f"No API key with id {key_id!r}; list them with 'backfill admin key list --org NAME'.",
        param="key_id",
    )


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def printable(value: str, param: str, max_chars: int, *, allow_empty: bool = False) -> str:
    """``value`` if it is printable text of at most ``max_chars`` characters, else a 400.

    Names end up in terminals, logs and tables: control characters (NUL, newline), bidi
    overrides and other invisible format characters could disguise one name as another.
    """
    if not value and not allow_empty:
        raise InvalidInput(f"'{param}' must not be empty.", code="invalid_value", param=param)
    if len(value) > max_chars:
        raise InvalidInput(
            f"'{param}' is {len(value)} characters long; the limit is {max_chars}.",
            code="invalid_value",
            param=param,
        )
    if not value.isprintable() or value != value.strip():
        raise InvalidInput(
            f"'{param}' may hold only printable characters, without leading or trailing "
            "spaces (no control, format or bidi characters).",
            code="invalid_value",
            param=param,
        )
    return value


def no_such_org(name: str) -> NotFound:
    return NotFound(f"No organization named {name!r}; create it first.")


async def find_org(store: TenantStore, name: str) -> Org:
    """The org named ``name``; NotFound otherwise (an impossible name never reaches the
    database)."""
    org = await store.org_by_name(name) if ids.plausible(name, MAX_ORG_NAME_CHARS) else None
    if org is None:
        raise no_such_org(name)
    return org


@dataclass(frozen=True, slots=True)
class Principal:
    org_id: str
    scopes: frozenset[str]
    # The key's id (never its secret): who acted, in the audit log.
    key_id: str

    def require(self, scope: str) -> None:
        # inference:write includes reading (SPEC §7.1).
        if scope in self.scopes or (scope == READ and WRITE in self.scopes):
            return
        raise Forbidden(
            f"This API key lacks the '{scope}' scope; create a key with it "
            f"(backfill admin key create --scopes {scope})."
        )


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key just made: the secret (shown this once) and what is stored about it."""

    secret: str
    key: ApiKey


class TenantService:
    def __init__(self, store: TenantStore, ledger: LedgerStore, clock: Clock) -> None:
        self._store = store
        self._ledger = ledger
        self._clock = clock

    async def create_org(self, name: str) -> Org:
        printable(name, "name", MAX_ORG_NAME_CHARS)
        org = Org(id=ids.org_id(), name=name, created_at=int(self._clock.now()))
        await self._store.create_org(org)
        return org

    async def create_key(self, org_name: str, scopes: frozenset[str]) -> str:
        """Make a key for ``org_name``; returns the secret, which is never stored."""
        return (await self.new_key(org_name, scopes)).secret

    async def new_key(
        self, org_name: str, scopes: frozenset[str], name: str | None = None
    ) -> NewKey:
        """Make a key for ``org_name`` with an optional ``name`` to recognise it by later."""
        unknown = scopes - SCOPES
        if unknown or not scopes:
            raise InvalidInput(
                f"Unknown scopes {sorted(unknown)}; use {WRITE} and/or {READ}.", param="scopes"
            )
        if name is not None:
            printable(name, "name", MAX_KEY_NAME_CHARS)
        org = await self.org(org_name)
        body = secrets.token_urlsafe(32)  # 256 bits
        prefix = KEY_PREFIX + body[:6]
        secret = f"{KEY_PREFIX}{body}"
        key_id = ids.key_id()
        # The audit log's target, when an admin action makes the key (domain/audit.py).
        audit.note_target(key_id)
        key = ApiKey(
            id=key_id,
            org_id=org.id,
            prefix=prefix,
            scopes=scopes,
            name=name,
            created_at=int(self._clock.now()),
        )
        await self._store.create_api_key(key, hash_secret(secret))
        return NewKey(secret, key)

    async def keys(self, org_name: str) -> list[ApiKey]:
        """Every key of an org, revoked ones included, oldest first."""
        org = await self.org(org_name)
        return await self._store.list_api_keys(org.id)

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key at once for every process; revoking a revoked key changes nothing."""
        key = None
        if ids.plausible(key_id):
            key = await self._store.revoke_api_key(key_id, int(self._clock.now()))
        if key is None:
            raise no_such_key(key_id)
        return key

    async def authenticate(self, secret: str | None) -> Principal:
        if not secret:
            raise Unauthorized(
                "No API key given; send it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        # Every request reads the key row: no process keeps a copy that could outlive a
        # revocation made by another process.
        key = await self._store.api_key_by_hash(hash_secret(secret))
        if key is None:
            raise Unauthorized("The API key is not valid; check it or create a new one.")
        if key.revoked_at is not None:
            raise Unauthorized(
                f"The API key {key.prefix}… ({key.id}) was revoked; use another key or ask an "
                "administrator for a new one.",
                code="revoked_api_key",
            )
        now = int(self._clock.now())
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION_S:
            await self._store.touch_api_key(key.id, now, LAST_USED_RESOLUTION_S)
        return Principal(org_id=key.org_id, scopes=key.scopes, key_id=key.id)

    async def bootstrap(self, name: str = "default", credit: int = 0) -> str | None:
        """On an empty database make org ``name`` with ``credit`` picodollars and return a key
        with both scopes."""
        if await self._store.count_orgs():
            return None
        org = await self.create_org(name)
        if credit > 0:
            await self._ledger.credit(org.id, credit, "starting credit", int(self._clock.now()))
        return await self.create_key(name, SCOPES)

    async def org(self, name: str) -> Org:
        return await find_org(self._store, name)


def checked_weight(weight: object) -> int:
    """An org's fair-share weight as an administrator sets it (400 ``invalid_value`` naming
    the field otherwise)."""
    try:
        return check_weight(weight)
    except WeightRefused as refused:
        raise InvalidInput(refused.message, code="invalid_value", param=refused.param) from None
