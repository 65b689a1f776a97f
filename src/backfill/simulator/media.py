"""Images and audio in a prompt: decoded, counted into prompt tokens, reported back.

Backfill sends media inline, so the simulated engine accepts only ``data:`` URLs holding
base64 and refuses ``http(s)`` URLs outright: a test that sees such a refusal proves a user's
URL reached an engine. The bytes are decoded but not parsed as an image or a sound.

Token rule (``docs/simulator.md``): an image is ``IMAGE_TOKENS`` tokens plus one per started
KiB of its decoded bytes; an audio clip is ``AUDIO_TOKENS`` plus one per started KiB. Each of
those tokens is a placeholder named by a digest of the bytes, so the prefix cache matches two
prompts that carry the same image at the same place, and no others.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from typing import Any

from backfill.simulator.fields import BadRequest

IMAGE_TOKENS = 64
AUDIO_TOKENS = 16
AUDIO_FORMATS = ("wav", "mp3")
IMAGE_DETAILS = ("auto", "low", "high")

NOTHING_RECEIVED: dict[str, Any] = {
    "images": 0,
    "image_bytes": 0,
    "audio": 0,
    "audio_bytes": 0,
    "image_types": [],
    "audio_formats": [],
}
"""The report of a prompt without media. Shared by every such reply: never mutate it."""


@dataclass
class Received:
    """The media of one request, in the order they came."""

    images: int = 0
    image_bytes: int = 0
    audio: int = 0
    audio_bytes: int = 0
    image_types: list[str] = field(default_factory=list)
    audio_formats: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "image_bytes": self.image_bytes,
            "audio": self.audio,
            "audio_bytes": self.audio_bytes,
            "image_types": list(self.image_types),
            "audio_formats": list(self.audio_formats),
        }


def image(url: object, param: str, received: Received) -> list[str]:
    """The prompt tokens of an image given by ``url``; ``param`` names it in a refusal."""
    if not isinstance(url, str):
        raise BadRequest(param, "the image URL must be a string")
    scheme = url[: url.find(":") + 1].lower()
    if scheme in ("http:", "https:"):
        raise BadRequest(
            param, "this engine does not fetch URLs: send the image inline as a data: URL"
        )
    if scheme != "data:":
        raise BadRequest(param, "the image URL must be a data: URL")
    media_type, data = _data_url(url, param)
    if not media_type.startswith("image/"):
        raise BadRequest(param, f"the data URL's media type {media_type!r} is not an image")
    raw = _base64(data, param, "image")
    received.images += 1
    received.image_bytes += len(raw)
    received.image_types.append(media_type)
    return _placeholders("image", raw, IMAGE_TOKENS)


def audio(data: object, audio_format: object, param: str, received: Received) -> list[str]:
    """The prompt tokens of an ``input_audio`` part; ``param`` names the part."""
    if audio_format not in AUDIO_FORMATS:
        raise BadRequest(f"{param}.format", "the audio format must be wav or mp3")
    assert isinstance(audio_format, str)
    if not isinstance(data, str):
        raise BadRequest(f"{param}.data", "the audio data must be a base64 string")
    raw = _base64(data, f"{param}.data", "audio")
    received.audio += 1
    received.audio_bytes += len(raw)
    received.audio_formats.append(audio_format)
    return _placeholders("audio", raw, AUDIO_TOKENS)


def detail(value: object, param: str) -> None:
    if value is not None and value not in IMAGE_DETAILS:
        raise BadRequest(param, "detail must be auto, low or high")


def _data_url(url: str, param: str) -> tuple[str, str]:
    """(media type, base64 text) of ``data:<media type>[;<parameter>]*;base64,<data>``."""
    header, comma, data = url[len("data:") :].partition(",")
    if not comma:
        raise BadRequest(param, "the data URL has no comma before its data")
    media_type, *parameters = header.split(";")
    if not parameters or parameters[-1].strip().lower() != "base64":
        raise BadRequest(param, "only base64 data URLs are supported")
    return media_type.strip().lower(), data


def _base64(data: str, param: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(param, f"the {what} data is not valid base64") from None
    if not raw:
        raise BadRequest(param, f"the {what} data is empty")
    return raw


def _placeholders(kind: str, raw: bytes, fixed: int) -> list[str]:
    token = f"<{kind} {hashlib.blake2b(raw, digest_size=8).hexdigest()}>"
    return [token] * (fixed + -(-len(raw) // 1024))
