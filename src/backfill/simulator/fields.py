"""Checks of request fields that every endpoint of the simulated engine shares.

A refused field raises ``BadRequest``; the simulator answers it with 400 in OpenAI's error
envelope, naming the field in ``param`` so a test can tell which check fired.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def is_int(value: object) -> bool:
    # bool is an int to Python, never to a JSON schema.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def only_known(body: dict[str, Any], known: Iterable[str]) -> None:
    """Refuse the first field not in ``known``: silently ignoring one would hide a client
    that sends what it should not."""
    allowed = set(known)
    for name in body:
        if name not in allowed:
            raise BadRequest(name, f"unknown field {name}")


def model(body: dict[str, Any]) -> str:
    value = body.get("model")
    if not isinstance(value, str) or not value:
        raise BadRequest("model", "model must be a non-empty string")
    return value


def optional_string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(name, f"{name} must be a string")
    return value


def priority(body: dict[str, Any]) -> int:
    """vLLM's request ``priority``: any integer (``priority: int = 0`` in its request models).
    Under fcfs, vLLM's default policy, it is accepted and ignored."""
    value = body.get("priority", 0)
    if not is_int(value):
        raise BadRequest("priority", "priority must be an integer")
    assert isinstance(value, int)
    return value
