"""Image and audio parts of a request (SPEC §5.4): their rules at upload, and how a request's
remote images are swapped for the inline copies Backfill fetched when it runs (SPEC §10.4).

Engines receive media inline only: a ``data:`` URL as the user sent it, or one Backfill made
from an ``https`` URL it fetched itself (``http`` too where the operator allows it), so no engine
ever fetches a user's URL.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
AUDIO_FORMATS = frozenset({"wav", "mp3"})
MAX_URL_CHARS = 8192


@dataclass(frozen=True, slots=True)
class MediaLimits:
    part_bytes: int = 10 * 1024 * 1024
    """Decoded bytes of one inline part; a fetched image is held to the same."""
    line_bytes: int = 16 * 1024 * 1024
    """Decoded bytes of all inline parts of one line."""
    parts_per_line: int = 32
    allow_http: bool = False
    """Whether an image URL may be plain ``http://`` (the fetch_allow_http setting)."""


# How each image type's bytes begin. A fetched image whose bytes do not begin so is refused:
# an HTML page or a compressed body served as an image must not reach an engine as one.
_SIGNATURES: dict[str, Callable[[bytes], bool]] = {
    "image/png": lambda data: data.startswith(b"\x89PNG\r\n\x1a\n"),
    "image/jpeg": lambda data: data.startswith(b"\xff\xd8\xff"),
    "image/gif": lambda data: data.startswith((b"GIF87a", b"GIF89a")),
    # A RIFF container whose form type is WEBP.
    "image/webp": lambda data: data[:4] == b"RIFF" and data[8:12] == b"WEBP",
}


def has_signature(content_type: str, data: bytes) -> bool:
    """Whether ``data`` begins as a ``content_type`` image does (True for a type Backfill
    knows no signature of)."""
    matches = _SIGNATURES.get(content_type)
    return matches is None or matches(data)


class MediaError(ValueError):
    """A part that breaks a rule; ``param`` is the field, relative to the line's body."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _decoded_size(data: str, where: str, limit: int) -> int:
    # The size is bounded before decoding, so an oversized part costs no decode.
    estimate = len(data) * 3 // 4
    if estimate > limit + 3:
        raise MediaError(
            "invalid_value",
            f"'{where}' holds about {estimate} bytes; one media part may hold at most {limit} "
            "bytes (the max_media_part_bytes setting).",
            where,
        )
    try:
        size = len(binascii.a2b_base64(data, strict_mode=True))
    except (binascii.Error, ValueError):
        raise MediaError(
            "invalid_value", f"'{where}' is not valid base64; encode the bytes with base64.", where
        ) from None
    if size > limit:
        raise MediaError(
            "invalid_value",
            f"'{where}' holds {size} bytes; one media part may hold at most {limit} bytes.",
            where,
        )
    return size


def check_image_url(url: Any, where: str, limits: MediaLimits) -> int:
    """Check an image URL (``data:image/...;base64,...``, ``https://...``, or ``http://...``
    where allowed); the inline bytes it holds (0 for a remote image, fetched and checked
    before the request reaches its engine)."""
    if not isinstance(url, str) or not url:
        raise MediaError("invalid_value", f"'{where}' must be a non-empty string URL.", where)
    if url.startswith("data:"):
        header, comma, data = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if not comma or encoding != "base64":
            raise MediaError(
                "invalid_value",
                f"'{where}' must be a base64 data URL: data:image/png;base64,<bytes>.",
                where,
            )
        if media_type.lower() not in IMAGE_TYPES:
            raise MediaError(
                "invalid_value",
                f"'{where}' has media type {media_type!r}; images must be one of "
                f"{', '.join(sorted(IMAGE_TYPES))}.",
                where,
            )
        return _decoded_size(data, where, limits.part_bytes)
    scheme = "https" if url.startswith("https://") else "http" if url.startswith("http://") else ""
    if scheme == "https" or (scheme == "http" and limits.allow_http):
        if len(url) > MAX_URL_CHARS or not url[len(scheme) + 3 :].split("/", 1)[0]:
            raise MediaError(
                "invalid_value",
                f"'{where}' must be an {scheme} URL with a host, at most {MAX_URL_CHARS} "
                "characters.",
                where,
            )
        return 0
    if limits.allow_http:
        raise MediaError(
            "invalid_value", f"'{where}' must be a data: URL, an https:// or an http:// URL.", where
        )
    raise MediaError(
        "invalid_value",
        f"'{where}' must be a data: URL or an https:// URL; Backfill fetches only public HTTPS "
        "images.",
        where,
    )


def check_audio(value: Any, where: str, limits: MediaLimits) -> int:
    """Check an ``input_audio`` object (inline only); the bytes it holds."""
    if not isinstance(value, dict) or set(value) - {"data", "format"}:
        raise MediaError(
            "invalid_value",
            f"'{where}' must be an object with 'data' (base64) and 'format' "
            f"({', '.join(sorted(AUDIO_FORMATS))}).",
            where,
        )
    if value.get("format") not in AUDIO_FORMATS:
        raise MediaError(
            "invalid_value",
            f"'{where}.format' must be one of {', '.join(sorted(AUDIO_FORMATS))} (it is "
            f"{value.get('format')!r}).",
            f"{where}.format",
        )
    data = value.get("data")
    if not isinstance(data, str) or not data:
        raise MediaError(
            "missing_required_parameter",
            f"'{where}.data' must be the audio bytes in base64.",
            f"{where}.data",
        )
    return _decoded_size(data, f"{where}.data", limits.part_bytes)


class LineMedia:
    """Adds up one line's media parts against the per-line limits."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.parts = 0
        self.bytes = 0

    def add(self, size: int, where: str) -> None:
        self.parts += 1
        self.bytes += size
        limits = self.limits
        if self.parts > limits.parts_per_line:
            raise MediaError(
                "invalid_value",
                f"'{where}' is media part {self.parts} of the line; a line may carry at most "
                f"{limits.parts_per_line}.",
                where,
            )
        if self.bytes > limits.line_bytes:
            raise MediaError(
                "invalid_value",
                f"the line's media parts hold {self.bytes} bytes up to '{where}'; a line may "
                f"carry at most {limits.line_bytes} bytes of media.",
                where,
            )


# ---- remote images, when a request runs ------------------------------------------------------

_ITEMS = msgspec.json.Decoder(list[Any])
_REMOTE = ("https://", "http://")


def may_hold_remote_images(raw: bytes) -> bool:
    """Whether JSON text ``raw`` can hold a string starting ``https://`` or ``http://``: it
    does so literally (``"http`` starts both), or spells it with escapes
    (``\\u0068ttps:\\/\\/``), which need ``\\u`` or ``\\/``. A quick scan that rules most
    lines out; the others are decoded and walked."""
    return b'"http' in raw or b"\\u" in raw or b"\\/" in raw


def remote_image_urls(body: Mapping[str, Any]) -> list[str]:
    """The remote (``https`` or ``http``) image URLs of a chat or Responses body (its fields
    as ``msgspec.Raw``). Both are found whatever the settings say now: a line uploaded while
    plain http was allowed must still never reach an engine with its URL."""
    urls: list[str] = []

    def collect(url: str) -> str:
        urls.append(url)
        return url

    _walk(body, collect)
    return urls


def inline_images(body: dict[str, Any], inline: Mapping[str, str]) -> dict[str, Any]:
    """``body`` with each remote image URL replaced by its inline ``data:`` URL."""
    return _walk(body, lambda url: inline.get(url, url))


def data_url(content_type: str, data: bytes) -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def _walk(body: Mapping[str, Any], swap: Callable[[str], str]) -> dict[str, Any]:
    """Apply ``swap`` to each remote image URL; only fields that held one are re-encoded, so
    the rest of the body still goes to the engine as the user wrote it."""
    out = dict(body)
    for name in ("messages", "input"):
        raw = body.get(name)
        data = bytes(raw) if isinstance(raw, msgspec.Raw) else b""
        # The cheap test first: most bodies have no remote image at all.
        if not may_hold_remote_images(data) or not data.lstrip().startswith(b"["):
            continue
        items = _ITEMS.decode(data)
        changed = False
        for holder, key in _image_urls(items):
            url = holder[key]
            if isinstance(url, str) and url.startswith(_REMOTE):
                holder[key] = swap(url)
                changed = changed or holder[key] != url
        if changed:
            out[name] = msgspec.Raw(msgspec.json.encode(items))
    return out


def _image_urls(items: list[Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Where each image URL of chat messages or Responses input items sits: the object that
    holds it, and its key there."""
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and isinstance(part.get("image_url"), dict):
                if "url" in part["image_url"]:
                    yield part["image_url"], "url"
            elif kind == "input_image" and "image_url" in part:
                yield part, "image_url"
