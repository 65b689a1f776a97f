"""What a failed typed decode said, as the field it names and the rule that field broke.

msgspec reports one problem per decode, as text such as ``Expected `int`, got `str` - at
`$.body.max_tokens```; request lines and request bodies both turn it into an error that names
the field (``param``) in the API's own words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import msgspec

# A JSON key may be empty: "unknown field ``" names one.
_MISSING = re.compile(r"Object missing required field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")


class Broken(Enum):
    MISSING = "missing"
    """A required field is absent."""
    UNKNOWN = "unknown"
    """A field the type does not have."""
    NOT_OBJECT = "not_object"
    """The whole document is not a JSON object."""
    INVALID = "invalid"
    """A field holds a value of the wrong type or form."""


@dataclass(frozen=True, slots=True)
class DecodeProblem:
    broken: Broken
    param: str | None
    """The field, dotted from the top (``body.messages[0].role``); None for the document."""
    reason: str
    """msgspec's words without the location, for ``INVALID``."""

    @property
    def field(self) -> str | None:
        """The top-level field the problem lies in."""
        return None if self.param is None else re.split(r"[.\[]", self.param, maxsplit=1)[0]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def explain(error: msgspec.ValidationError) -> DecodeProblem:
    text = str(error)
    if m := _MISSING.match(text):
        return DecodeProblem(Broken.MISSING, _join(m.group(2) or "", m.group(1)), text)
    if m := _UNKNOWN.match(text):
        return DecodeProblem(Broken.UNKNOWN, _join(m.group(2) or "", m.group(1)), text)
    at = _AT.search(text)
    if at is None and text.startswith("Expected `object`"):
        return DecodeProblem(Broken.NOT_OBJECT, None, text)
    return DecodeProblem(Broken.INVALID, at.group(1) if at else None, _AT.sub("", text))
