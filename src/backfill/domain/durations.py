"""Completion windows such as ``24h`` or ``90m``, and BatchRouter assignment windows."""

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


# BatchRouter writes assignment windows as Go durations (what Go's time.Duration prints, so
# "1h30m0s" and "1.5s" too) or as ISO 8601 durations. Years and months are left out: they have
# no fixed length. Digits are bounded so a hostile value costs nothing to read.
_NUMBER = r"[0-9]{1,10}(?:\.[0-9]{1,9})?"
_GO = re.compile(rf"(?:({_NUMBER})h)?(?:({_NUMBER})m)?(?:({_NUMBER})s)?(?:({_NUMBER})ms)?")
_GO_UNITS = (3600, 60, 1, 0.001)
_ISO = re.compile(
    rf"P(?:([0-9]{{1,10}})W|(?:([0-9]{{1,10}})D)?"
    rf"(?:T(?:([0-9]{{1,10}})H)?(?:([0-9]{{1,10}})M)?(?:({_NUMBER})S)?)?)"
)
_ISO_UNITS = (7 * 86400, 86400, 3600, 60, 1)


def parse_go_or_iso_duration(text: str) -> float:
    """Seconds in a Go duration (``90m``, ``1h30m``, ``3600s``) or an ISO 8601 one (``PT6H``,
    ``P1DT2H``); raises ValueError naming both forms. Zero is refused: nothing lasts no time."""
    units: tuple[float, ...] = _GO_UNITS
    match = _GO.fullmatch(text)
    if match is None or match.lastindex is None:
        units = _ISO_UNITS
        match = _ISO.fullmatch(text)
    # The patterns also match "", "P" and "PT" (every part is optional), and "P1DT".
    if match is None or match.lastindex is None or text.endswith("T"):
        raise ValueError(
            f"{text!r} is not a duration; use a Go duration such as '90m', '6h' or '1h30m', "
            "or an ISO 8601 one such as 'PT6H' or 'PT90M' (no years or months)"
        )
    seconds = sum(
        float(part) * unit for part, unit in zip(match.groups(), units, strict=True) if part
    )
    if seconds <= 0:
        raise ValueError(f"{text!r} is no time at all; a duration must be positive")
    return seconds
