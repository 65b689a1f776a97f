"""Prefix locality (SPEC §9.5): lines that share a prompt prefix go to the same replica, back
to back, so its prefix cache holds the prefix while they run.

A line's prefix is its BatchRouter section when it came from one (a section's requests share its
prefix messages, and the user said they belong together), else its leading messages (every
message but the last: the system prompt and any shared turns), or, for a single message or a
completions prompt, its first ``SINGLE_PROMPT_PREFIX`` bytes. Replicas are chosen by rendezvous
hashing, the same on every worker process, bounded by the room each replica has now, so no
replica idles while a popular prefix waits for its favourite.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

SINGLE_PROMPT_PREFIX = 1024


class _Line(msgspec.Struct):
    body: dict[str, msgspec.Raw]
    section: str | None = None


_LINE = msgspec.json.Decoder(_Line)
_MESSAGES = msgspec.json.Decoder(list[msgspec.Raw])


def prefix_key(line: bytes) -> bytes:
    """A digest of the line's prompt prefix; lines with the same one share a cached prefix."""
    try:
        decoded = _LINE.decode(line)
        if decoded.section is not None:
            prefix = b"section\0" + decoded.section.encode()
        else:
            prefix = _prefix(decoded.body)
    except (msgspec.DecodeError, ValueError):
        prefix = b""
    return hashlib.blake2b(prefix, digest_size=16).digest()


def _prefix(body: dict[str, Any]) -> bytes:
    messages = body.get("messages")
    if isinstance(messages, msgspec.Raw):
        parts = _MESSAGES.decode(messages)
        if len(parts) > 1:
            return b",".join(bytes(p) for p in parts[:-1])
        return bytes(parts[0])[:SINGLE_PROMPT_PREFIX] if parts else b""
    # A completions prompt, or the input of an embeddings or Responses line.
    prompt = body.get("prompt") or body.get("input")
    return bytes(prompt)[:SINGLE_PROMPT_PREFIX] if isinstance(prompt, msgspec.Raw) else b""


def _score(key: bytes, replica: bytes) -> bytes:
    return hashlib.blake2b(key + replica, digest_size=8).digest()


def assign(keys: Sequence[bytes], replicas: Sequence[str], room: Sequence[int]) -> list[int]:
    """The replica (an index into ``replicas``) of each key: its highest-scoring replica that
    still has room, else the one with the most room left. Keys are taken in order, so lines
    sorted by key reach their replica back to back."""
    names = [r.encode() for r in replicas]
    left = list(room)
    ranked: dict[bytes, list[int]] = {}
    chosen: list[int] = []
    for key in keys:
        order = ranked.get(key)
        if order is None:
            scores = [_score(key, name) for name in names]
            order = sorted(range(len(names)), key=scores.__getitem__, reverse=True)
            ranked[key] = order
        pick = next((r for r in order if left[r] > 0), None)
        if pick is None:
            pick = max(range(len(left)), key=left.__getitem__)
        left[pick] -= 1
        chosen.append(pick)
    return chosen
