"""Completion windows such as ``24h`` or ``90m``."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PATTERN = re.compile(r"^([1-9][0-9]{0,9})(ms|s|m|h|d)$")


def parse_duration(text: str) -> float:
    """Seconds in ``text``; raises ValueError with a message naming the accepted form."""
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration; use a whole number followed by ms, s, m, h or d, "
            "for example '24h'"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def format_seconds(seconds: float) -> str:
    """Shortest exact ``<int><unit>`` form of ``seconds``."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{round(seconds * 1000)}ms"
