"""The Batches page: one HTML shell, a stylesheet and plain ES modules, served from the
package (docs/dashboard.md).

The page holds no secret and needs no authentication: the browser keeps the key in the
tab's session storage and sends it as a bearer header on every API call, so there is no
cookie and no cross-site request can act with it. The headers keep the page from being
framed and its scripts to this origin's own files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Header
from starlette.responses import Response

from backfill.errors import NotFound

STATIC = "static"
ASSETS_PREFIX = "/dashboard/"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    # The files change with each release; the ETag makes a revalidation cheap.
    "cache-control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def _load() -> dict[str, Asset]:
    """Every file of the static folder, read once: the names a request may ask for are
    these, so no path from a URL ever reaches the file system."""
    found: dict[str, Asset] = {}
    folder = resources.files("backfill.adapters.http").joinpath(STATIC)
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in TYPES:
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            found[entry.name] = Asset(body, TYPES[suffix], etag)
    return found


ASSETS = _load()
router = APIRouter(include_in_schema=False)


def _serve(name: str, if_none_match: str | None) -> Response:
    asset = ASSETS.get(name)
    if asset is None:
        raise NotFound(f"No dashboard file named {name[:100]!r}; open / for the Batches page.")
    headers = {**SECURITY_HEADERS, "etag": asset.etag}
    if if_none_match is not None and asset.etag in if_none_match:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


@router.get("/")
async def page(
    if_none_match: Annotated[str | None, Header(alias="if-none-match")] = None,
) -> Response:
    return _serve("index.html", if_none_match)


@router.get(ASSETS_PREFIX + "{name}")
async def asset(
    name: str,
    if_none_match: Annotated[str | None, Header(alias="if-none-match")] = None,
) -> Response:
    return _serve(name, if_none_match)
